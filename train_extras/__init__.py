"""Optional modules that the training scripts import only when a flag asks for them (common.optional): other
datasets, torchvision models, fine-tuning, sharded checkpoints, torchrun restarts. A script and common.py run
alone without those flags: copy this folder too only if you use them."""
