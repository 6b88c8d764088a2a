"""Data: the built-in tiny model and tokenizer, synthetic tasks, prompt datasets and reward functions."""

from . import long_task  # registers the built-in task "long"
from .datasets import DatasetStats, PromptDataset, PromptItem, extract_final_answer, read_rows
from .rewards import exact_match, math_reward, register_reward, resolve_reward_fn, score_safely
from .tasks import AdditionTask, available_tasks, get_task, register_task
from .tiny import build_tiny_model, build_tokenizer, ensure_builtin_model, resolve_model_path

__all__ = [
    "AdditionTask", "DatasetStats", "PromptDataset", "PromptItem", "available_tasks", "build_tiny_model",
    "build_tokenizer", "ensure_builtin_model", "exact_match", "extract_final_answer", "get_task", "math_reward",
    "read_rows", "register_reward", "register_task", "resolve_model_path", "resolve_reward_fn", "score_safely",
]
