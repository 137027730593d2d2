"""What every layer may use: checks and their errors, device values, CPU threads,
key mixing, counters, the marks on optimizers."""
