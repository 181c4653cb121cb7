"""`--model-label-limit` shared by the workers of `--workers N`: two `SharedModelLabels` on one directory
behave as one `ModelLabels` would."""

from __future__ import annotations

from pathlib import Path

from proxy.observe.metrics import ModelLabels
from proxy.workers.shared_labels import SharedModelLabels


def test_the_first_names_the_set_sees_keep_their_label_in_every_worker(tmp_path: Path) -> None:
    a, b = SharedModelLabels(2, str(tmp_path)), SharedModelLabels(2, str(tmp_path))
    assert a.label("m1") == "m1"
    assert b.label("m2") == "m2"
    assert b.label("m3") == "other"  # the set's two slots are taken, though b admitted only one name
    assert a.label("m3") == "other"
    assert b.label("m1") == "m1"  # admitted by a, known to b
    assert a.label("m2") == "m2"


def test_same_answers_as_one_process(tmp_path: Path) -> None:
    names = ["x", "y", "x", "z", None, "", "w", "y", "q" * 150, "z"]
    one = ModelLabels(3)
    workers = [SharedModelLabels(3, str(tmp_path)) for _ in range(3)]
    assert [workers[i % 3].label(name) for i, name in enumerate(names)] == [one.label(name) for name in names]


def test_served_names_keep_their_label_past_the_limit(tmp_path: Path) -> None:
    labels = SharedModelLabels(1, str(tmp_path))
    labels.set_served(["served"])
    assert labels.label("junk") == "junk"
    assert labels.label("junk2") == "other"
    assert labels.label("served") == "served"


def test_odd_names_survive_the_file(tmp_path: Path) -> None:
    a, b = SharedModelLabels(5, str(tmp_path)), SharedModelLabels(5, str(tmp_path))
    odd = 'line\nbreak "quoted" \u00e9\u2603'
    assert a.label(odd) == odd
    assert b.label("other-worker") == "other-worker"
    assert b.label(odd) == odd
    assert not list(tmp_path.glob("*.db"))  # never read as a metrics file
