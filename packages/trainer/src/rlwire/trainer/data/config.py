"""The sections of the configuration that the data code owns: ``data`` (the training rows),
``validation`` (held-out prompts) and ``reward``. The trainer's configuration
(:mod:`rlwire.trainer.config`) assembles them; nothing here imports the rest of ``data/``,
so no config module reaches the data code.

Imports ``checks``, ``algorithms.shaping`` and ``rollout`` (the sampling of a validation)."""

from __future__ import annotations

import dataclasses

from ..algorithms.shaping import OverlongBufferConfig
from ..checks import check
from ..rollout import Sampling

__all__ = ["DataConfig", "RewardConfig", "ValidationConfig"]


TRUNCATIONS = ("error", "left", "right", "middle")


def check_sources(value: str | list[str], key: str) -> None:
    """A source is one name, or a non-empty list of files or Hub ids (no built-in task:
    a task's prompts are generated, never read alongside a file's)."""
    if isinstance(value, str):
        return
    check(
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, str) and not v.startswith("builtin:") for v in value),
        key,
        value,
        "use one source, or a non-empty list of files or Hub dataset ids (not builtin:)",
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    source: list[str] | str = "builtin:repeat"
    """``builtin:repeat`` (the built-in verifiable task: answer a letter with that
    letter, partial credit per character), ``builtin:count`` (answer a letter and a count,
    ``c3:``, with the letter that many times and stop: response lengths with a long tail;
    the ``realistic`` preset's), ``builtin:lookup`` (multi-turn: call a tool and answer with
    what it returned; with its own ``agent`` settings and primed model), a JSONL/Parquet
    file, or a Hub dataset id (``org/name``, with ``subset`` and ``split``: downloaded
    through ``huggingface_hub`` on first use, from its cache after that and with
    ``HF_HUB_OFFLINE=1``, read with ``datasets``; extra ``rlwire-trainer[datasets]``).
    A list of files or Hub ids (verl's ``data.train_files``) is read as one data set, in
    the order given."""
    subset: str | None = None
    """A Hub dataset's configuration (``datasets``' ``name``, TRL's ``dataset_config``:
    ``main`` for ``openai/gsm8k``)."""
    split: str = "train"
    """A Hub dataset's split to train on (TRL's ``dataset_train_split``)."""
    prompt_key: str = "prompt"
    """Field holding the prompt in a user file: text, or a list of chat messages (verl's
    layout) rendered with the tokenizer's chat template. Dots address nested fields."""
    answer_key: str | None = None
    """Field holding the ground truth (dots address nested fields, e.g.
    ``reward_model.ground_truth``). None: ``answer``, else verl's
    ``reward_model.ground_truth``."""
    train_batch_size: int = 8
    """Prompts per step (each sampled ``rollout.n`` times)."""
    max_prompt_length: int | None = None
    """Longest prompt of a data file in tokens (after the chat template), verl's key. A
    longer row stops the run naming it, or is dropped with ``filter_overlong_prompts``.
    In any case a prompt must leave ``rollout.max_new_tokens`` of the model's context
    (``max_position_embeddings``, or ``rollout.vllm.max_model_len`` with vLLM). None: that
    bound only. Every row is tokenized at start to check; ``truncation`` says what a longer
    one does."""
    filter_overlong_prompts: bool = False
    """Drop the rows of a data file whose prompt is over the limit above (the count is
    logged) instead of stopping the run: verl's key."""
    truncation: str = "error"
    """What a prompt over the limits above does when ``filter_overlong_prompts`` is off
    (verl's key): ``error`` stops the run naming its row; ``left`` keeps its last tokens,
    ``right`` its first, ``middle`` both ends (the count is logged). A cut prompt is text
    from then on: a cut chat-message row is refused with the agent on, whose conversations
    start from the messages."""
    shuffle: bool = True
    """Walk a data file's rows in a new order each epoch (verl's key and default; TRL
    shuffles too), drawn from ``trainer.seed`` and the epoch: the same seed gives the same
    order, and a resumed run continues it exactly. False: the file's order, every epoch.
    A built-in task draws fresh prompts every step either way."""

    def __post_init__(self) -> None:
        check_sources(self.source, "data.source")
        check(
            self.truncation in TRUNCATIONS,
            "data.truncation",
            self.truncation,
            f"use one of {list(TRUNCATIONS)}",
        )
        check(
            self.train_batch_size >= 1,
            "data.train_batch_size",
            self.train_batch_size,
            "use an int >= 1",
        )
        check(
            self.max_prompt_length is None or self.max_prompt_length >= 1,
            "data.max_prompt_length",
            self.max_prompt_length,
            "use an int >= 1, or null (the model's context less rollout.max_new_tokens)",
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class RewardConfig:
    function: list[str] | str | None = None
    """The reward, or a list of them (TRL's ``reward_funcs``). Unset: a built-in task's own
    reward; for a data file, the scorer each row's ``data_source`` names, as verl's
    ``default_compute_score`` does (``openai/gsm8k``: gsm8k; ``lighteval/MATH``,
    ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``, ``math``,
    ``math_dapo``, ``aime*``: math), a source with none refused at start. Names:
    ``builtin`` (the built-in task's reward, for its data only), ``gsm8k`` (the
    ``#### answer`` format), ``math`` (boxed answers checked with ``math-verify``; extra
    ``rlwire-trainer[math]``), or ``module.path:function`` / ``file.py:function`` with
    verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)`` (a float, or a dict with ``"score"`` whose other numbers become
    metrics and may be ``algorithm.filter_groups.metric``), TRL's ``f(prompts,
    completions, completion_ids, **kwargs)`` (every other column by name; a float or None
    per completion) or a batch ``f(prompts, responses, answers) -> list[float]``; the
    signature is checked at start. verl's ``custom_reward_function.path`` and ``.name`` are
    accepted."""
    model: str | None = None
    """A reward model (verl's ``reward_model.model.path``): a sequence-classification
    model's directory or Hub id, one label, scoring each prompt + completion as TRL scores
    with a model in ``reward_funcs`` (:mod:`rlwire.trainer.data.reward_model`). It counts
    after the functions (``weights``); with ``function`` unset it scores alone. A model
    directory or Hub id given in ``function`` (or TRL's ``reward_funcs``) is one too."""
    model_batch_size: int = 32
    """Texts per forward pass of a reward model."""
    model_device: str = "auto"
    """Where a reward model runs, in the driver: ``auto`` (its first GPU, else the CPU),
    ``cpu`` or ``cuda:<i>``."""
    weights: list[float] | None = None
    """One weight per function of a list (TRL's ``reward_weights``), then one for
    ``model``: the reward is ``sum(weight x value)``, a None (not applicable) left out.
    None: 1 each."""
    overlong_buffer: OverlongBufferConfig = dataclasses.field(default_factory=OverlongBufferConfig)

    def __post_init__(self) -> None:
        specs = self.function if isinstance(self.function, list) else [self.function]
        check(
            self.function is None or (bool(specs) and all(isinstance(s, str) and s for s in specs)),
            "reward.function",
            self.function,
            "use a name, package.module:function, or a list of them",
        )
        weights = self.weights
        count = (len(specs) if self.function is not None or not self.model else 0) + bool(
            self.model
        )
        check(
            weights is None
            or (
                isinstance(weights, list)
                and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
                and len(weights) == count
            ),
            "reward.weights",
            weights,
            f"use a list of {count} number(s), one per reward.function (then reward.model)",
        )
        check(
            self.model_batch_size >= 1,
            "reward.model_batch_size",
            self.model_batch_size,
            "use an int >= 1",
        )
        check(
            self.model_device == "auto"
            or self.model_device == "cpu"
            or self.model_device.startswith("cuda"),
            "reward.model_device",
            self.model_device,
            "use auto, cpu or cuda:<index>",
        )

    def specs(self) -> list[str]:
        """The functions named (none when unset)."""
        if self.function is None:
            return []
        return list(self.function) if isinstance(self.function, list) else [self.function]


@dataclasses.dataclass(kw_only=True, slots=True)
class ValidationConfig:
    source: list[str] | str | None = None
    """Held-out prompts (verl's ``data.val_files``): a JSONL or Parquet file or a Hub
    dataset read like ``data.source``, or ``builtin:<task>`` (``prompts`` of them, apart
    from the training ones). None: no validation."""
    split: str = "test"
    """A Hub dataset's split for validation (TRL's ``dataset_test_split``)."""
    every: int = 0
    """Validate after every ``every`` updates and after the last (verl's
    ``trainer.test_freq``; its -1 is 0). 0: not during training."""
    before_train: bool = False
    """Validate the weights the run starts from, before its first update (verl's
    ``trainer.val_before_train``)."""
    n: int = 1
    """Samples per prompt (verl's ``rollout.val_kwargs.n``); the metrics average them."""
    temperature: float = 0.0
    """Sampling temperature (``val_kwargs.temperature``) when ``do_sample``."""
    do_sample: bool = False
    """Sample (``val_kwargs.do_sample``); false: the most likely token each step."""
    prompts: int = 64
    """With ``builtin:<task>``: how many held-out prompts."""

    def __post_init__(self) -> None:
        if self.source is not None:
            check_sources(self.source, "validation.source")
        check(self.every >= 0, "validation.every", self.every, "use an int >= 0 (0: never)")
        check(self.n >= 1, "validation.n", self.n, "use an int >= 1")
        check(self.prompts >= 1, "validation.prompts", self.prompts, "use an int >= 1")
        check(
            not self.do_sample or self.temperature > 0,
            "validation.temperature",
            self.temperature,
            "sampling (validation.do_sample) needs a float > 0",
        )

    @property
    def sampling(self) -> Sampling:
        return Sampling(n=self.n, temperature=self.temperature, greedy=not self.do_sample)
