"""The fuzzer over the trainer's parsers of bytes another process (or another machine)
wrote: a checkpoint's MANIFEST.json. Mutated at random, it is either accepted (only when the
files match it) or refused with one RunError; it never reads outside the checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs.checkpoint import check_manifest, write_manifest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("RLWIRE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(st.data())
def test_a_mutated_manifest_is_accepted_only_when_true_or_refused(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("step_4")
    (directory / "actor").mkdir()
    (directory / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)))
    (directory / "trainer_state.json").write_text('{"step": 4}')
    write_manifest(directory)
    genuine = (directory / "MANIFEST.json").read_bytes()
    entries = json.loads(genuine)
    kind = data.draw(st.sampled_from(["bytes", "json"]))
    if kind == "bytes":
        raw = bytearray(genuine)
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        mutated = bytes(raw)
    else:
        value = data.draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3)
                ),
                max_leaves=8,
            )
        )
        name = data.draw(st.sampled_from([*entries, "../outside", "/etc/hostname", "x"]))
        field = data.draw(st.sampled_from(["bytes", "sha256", None]))
        changed = dict(entries)
        changed[name] = value if field is None else {**entries.get(name, {}), field: value}
        mutated = json.dumps(changed).encode()
    (directory / "MANIFEST.json").write_bytes(mutated)
    try:
        check_manifest(directory, missing="require")
    except RunError:
        return
    assert json.loads(mutated) == entries  # accepted: it says what the files are
