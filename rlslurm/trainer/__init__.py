"""Trainer side (het-group 0): Megatron-core actor/critic training and the RL math it needs."""
