"""The TRACE RL loop: embedded reference engine, Megatron trainer, controller, config (docs/rl.md)."""
