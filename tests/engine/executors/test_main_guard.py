"""Scripts that start a TP=2 engine, run as users run them: with a main guard the workers start and generate;
without one, LLM(...) fails at once saying what to do (instead of "worker rank 0 exited unexpectedly")."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmplug.engine.executors.main_guard import _is_guarded
from tests.engine.executors.parity import ENGINE_KWARGS, make_parallel_tiny, prompts
from tests.engine.test_llm import hf_greedy

REPO = Path(__file__).resolve().parents[3]
MAX_TOKENS = 6

GENERATE = """
from llmplug import LLM, SamplingParams

def generate(model):
    llm = LLM(model, tensor_parallel_size=2, **{engine})
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts}],
                        SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    llm.shutdown()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_parallel_tiny("llama", tmp_path_factory.mktemp("llama"))


def run_script(tmp_path: Path, body: str, tiny) -> subprocess.CompletedProcess:
    header = "import json\nimport sys\n" + GENERATE.format(engine=ENGINE_KWARGS, prompts=prompts()[:2],
                                                           max_tokens=MAX_TOKENS)
    script = tmp_path / "script.py"
    script.write_text(header + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tiny.path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.slow
def test_a_guarded_script_starts_its_workers_and_generates(tiny, tmp_path):
    done = run_script(tmp_path, """
        if __name__ == "__main__":
            generate(sys.argv[1])
        """, tiny)
    assert done.returncode == 0, done.stderr
    expected = [hf_greedy(tiny.hf_model, p, MAX_TOKENS) for p in prompts()[:2]]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_an_unguarded_script_fails_at_once_saying_what_to_do(tiny, tmp_path):
    done = run_script(tmp_path, """
        generate(sys.argv[1])
        """, tiny)
    assert done.returncode != 0
    assert "StartupError" in done.stderr and f"{tmp_path / 'script.py'}, line" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "exited unexpectedly" not in done.stderr and "bootstrapping phase" not in done.stderr  # no worker ran


@pytest.mark.parametrize("source,line,guarded", [
    ('x = 1\nif __name__ == "__main__":\n    main()\n', 3, True),
    ("x = 1\nif '__main__' == __name__:\n    main()\n", 3, True),
    ('main()\nif __name__ == "__main__":\n    pass\n', 1, False),
    ('if __name__ == "__main__":\n    pass\nelse:\n    main()\n', 4, False),
    ('if __name__ != "__main__":\n    main()\n', 2, False),
])
def test_the_guard_is_recognized(source, line, guarded):
    assert _is_guarded(ast.parse(source), line) is guarded
