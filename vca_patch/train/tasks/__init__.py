"""Recovery tasks, registered by name: classification (images, logits or features) and diffusion (latents).

Importing this package registers the built-in tasks (and their stage losses).
"""

from vca_patch.train.tasks import classification, diffusion
from vca_patch.train.tasks.base import TASKS, Task, TaskData, register_task, task_for, task_name, teacher_from

__all__ = [
    "TASKS",
    "Task",
    "TaskData",
    "classification",
    "diffusion",
    "register_task",
    "task_for",
    "task_name",
    "teacher_from",
]
