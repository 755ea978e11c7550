"""Models: loading and saving the Hugging Face policy, LoRA, the built-in tiny models.

Imports only the trainer's foundation (``errors``, ``checks``, ``plugins``)."""
