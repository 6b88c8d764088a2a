"""asyncppo: asynchronous off-policy streaming PPO for language models."""
__version__ = "0.1.0"
