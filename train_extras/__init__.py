"""Optional modules that the training scripts import only when a flag, or a default, asks for them
(common.optional): the built-in data (synthetic, the default, and MNIST, CIFAR-10, image folders)
and models (cnn, the default, and torchvision's), fine-tuning, sharded checkpoints, torchrun
restarts. With your own Dataset and nn.Module in place of common.load_data and common.make_model
(README, "Adapting"), a script and common.py run alone."""
