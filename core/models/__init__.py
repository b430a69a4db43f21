"""nn.Modules for the target family and the drafters, plus HF-format loading."""
