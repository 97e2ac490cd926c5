"""Training a run: the loop (`train`), its checkpoints and identity (`checkpoint`, `run_state`),
seeds, precision, optimizer and schedule (`recipe`), stopping and preemption (`stopping`,
`preempt`), torchrun/DDP (`distributed`), the weight average (`ema`), fine-tuning's source
weights (`finetune`), validation (`validation`), GPU and memory probes (`probes`) and where a
step's batches come from (`feeds`).

May import: the shared top level, `ctseg.preprocess`, `ctseg.data` and `ctseg.network`.
"""
