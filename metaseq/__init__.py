"""metaseq-reshard: OPT-style LM, FSDP training and checkpoint resharding."""
