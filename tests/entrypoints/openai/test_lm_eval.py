"""lm-evaluation-harness for real: `local-completions` against the server scores a small loglikelihood task
(a JSONL written here) exactly as lm-eval's own `hf` model does on the same weights (float32, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

TASK = "llmplug_tiny_choices"
DOCS = [
    ("The capital of France is", ["Paris", "London", "Rome", "Berlin"], 0),
    ("Two plus two equals", ["four", "five", "three", "seven"], 0),
    ("The sky on a clear day is", ["green", "blue", "red", "black"], 1),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Celsius", "Rankine"], 2),
    ("A cat says", ["woof", "moo", "quack", "meow"], 3),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The sun rises in the", ["west", "north", "east", "south"], 2),
    ("A week has seven", ["hours", "months", "years", "days"], 3),
    ("Ice is frozen", ["water", "sand", "air", "fire"], 0),
    ("The largest planet of the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Paper is made from", ["stone", "glass", "wood", "iron"], 2),
    ("Fish live in", ["trees", "deserts", "clouds", "water"], 3),
    ("Snow is usually", ["white", "purple", "orange", "brown"], 0),
    ("The number after nine is", ["eight", "ten", "six", "one"], 1),
    ("We hear with our", ["eyes", "hands", "ears", "feet"], 2),
    ("A triangle has three", ["wheels", "colors", "names", "sides"], 3),
    ("Bread is baked in an", ["oven", "ocean", "engine", "envelope"], 0),
    ("The moon orbits the", ["Sun", "Earth", "Mars", "comet"], 1),
    ("Rain falls from the", ["ground", "river", "clouds", "roots"], 2),
]


def write_task(folder: Path) -> None:
    """A multiple-choice task over a local JSONL: nothing is fetched from the hub."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (folder / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")


def evaluate(model: str, model_args: dict, task_folder: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, log_samples=True,
                           task_manager=TaskManager(include_path=str(task_folder), include_defaults=False),
                           random_seed=0)


def per_doc(results: dict) -> dict[int, tuple[list[float], list[bool], float, float]]:
    """Per document: each choice's loglikelihood and whether it is the greedy continuation; acc and acc_norm."""
    return {s["doc_id"]: ([float(r[0]) for r in s["filtered_resps"]], [bool(r[1]) for r in s["filtered_resps"]],
                          s["acc"], s["acc_norm"])
            for s in results["samples"][TASK]}


def test_lm_eval_local_completions_scores_equal_lm_eval_hf(server, tiny_chat_model, tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    write_task(tmp_path)
    reference = evaluate("hf", {"pretrained": str(tiny_chat_model), "dtype": "float32", "device": "cpu"}, tmp_path)
    expected = reference["results"][TASK]
    print(f"lm_eval scores: hf acc {expected['acc,none']:.4f} acc_norm {expected['acc_norm,none']:.4f}")
    for tokenized in (True, False):  # prompts sent as token ids, then as text
        served = evaluate("local-completions", {
            "model": server.model, "base_url": f"{server.base_url}/v1/completions", "tokenizer": str(tiny_chat_model),
            "tokenizer_backend": "huggingface", "tokenized_requests": tokenized, "num_concurrent": 1, "max_retries": 1,
        }, tmp_path)
        assert_equal_scores(served, reference, f"tokenized_requests={tokenized}")


def assert_equal_scores(served: dict, reference: dict, how: str) -> None:
    got, expected = served["results"][TASK], reference["results"][TASK]
    print(f"lm_eval scores: local-completions ({how}) acc {got['acc,none']:.4f} acc_norm {got['acc_norm,none']:.4f}")
    for metric in ("acc,none", "acc_norm,none"):
        assert got[metric] == expected[metric], (metric, how)
    served_docs, reference_docs = per_doc(served), per_doc(reference)
    assert sorted(served_docs) == list(range(len(DOCS)))
    for doc_id, (lls, greedy, acc, acc_norm) in reference_docs.items():
        got_lls, got_greedy, got_acc, got_acc_norm = served_docs[doc_id]
        assert got_lls == pytest.approx(lls, abs=1e-3), (doc_id, how)
        assert all(math.isfinite(ll) and ll < 0 for ll in got_lls)
        assert (got_greedy, got_acc, got_acc_norm) == (greedy, acc, acc_norm), (doc_id, how)
    worst = max(abs(a - b) for d in reference_docs for a, b in zip(served_docs[d][0], reference_docs[d][0]))
    print(f"largest loglikelihood difference ({how}): {worst:.2e}")
