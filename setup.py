from setuptools import find_packages, setup

setup(
    name="metaseq-reshard",
    version="0.1.0",
    description="Reshard fairscale FSDP checkpoints of OPT-style language models",
    packages=find_packages(include=["metaseq", "metaseq.*"]),
    package_data={"metaseq": ["assets/*.txt"]},  # the demo corpus
    python_requires=">=3.10",
    # Permissive on purpose: users on GPUs keep their own torch build.
    # The Makefile pins exact versions through constraints.txt.
    install_requires=["torch>=2.1", "fairscale>=0.4.13", "numpy", "tqdm"],
    # test: pytest-xdist runs the tests in parallel (filelock: the workers share the training runs);
    # omegaconf writes upstream-style consolidated files (a DictConfig cfg) in the fixtures
    # of tests/real_metaseq.py.
    # bench: only `python -m metaseq.scripts.benchmark_reshard --plot` needs it.
    # hf: the Hugging Face bridge (metaseq.hf, convert_to_hf / convert_from_hf); transformers 5
    # has OPTForCausalLM (with `dtype` in config.json). Exact versions in constraints.txt.
    extras_require={
        "test": ["pytest>=7", "pytest-xdist>=3", "filelock>=3", "hypothesis>=6", "omegaconf>=2.1"],
        "bench": ["matplotlib"],
        "hf": ["transformers>=5,<6", "safetensors>=0.4", "tokenizers>=0.20"],
    },
)
