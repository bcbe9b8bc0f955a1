from setuptools import find_packages, setup

setup(
    name="metaseq-reshard",
    version="0.1.0",
    description="Reshard fairscale FSDP checkpoints of OPT-style language models",
    packages=find_packages(include=["metaseq", "metaseq.*"]),
    python_requires=">=3.10",
    # Permissive on purpose: users on GPUs keep their own torch build.
    # The Makefile pins exact versions through constraints.txt.
    install_requires=["torch>=2.1", "fairscale>=0.4.13", "numpy", "tqdm"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6"]},
)
