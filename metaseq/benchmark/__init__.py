"""Benchmark support for the reshard tool: synthetic checkpoints, measurement, baselines.

`synth` writes raw FSDP checkpoints of any size straight in the on-disk format,
`measure` times a command and samples its process tree's memory, `reference`
holds the contenders the tool is compared with, and `runner` puts them together
for `python -m metaseq.scripts.benchmark_reshard`.
"""
