"""What every run needs around its maths: typed configs (`config`), the run directory (`rundir`),
atomic checkpoints (`checkpoint`), torch.distributed (`distributed`, `slicing`, `launch`),
experiment trackers, Ctrl-C handling, the optimizer, the hub probe, and the user's code, loaded
by name and called under a deadline (`user_code`). Kept free of torch at import where `--help`
reads it (`config`, `config_help`, `trackers`, `interrupt`)."""
