"""Prompt datasets (JSONL / Parquet, field mapping, chat template, length filter, seeded epochs, resume position)
and reward functions (Math-Verify equivalence of boxed answers, exact match, loading by path, thread and process
pools)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_tiny import tokenizer
from trace_rl.data import AdditionData, AdditionTokenizer, DatasetError, PromptDataset, read_rows
from trace_rl.rewards import RewardPool, exact_match, load_reward, math
from trace_rl.task import AdditionTask

DATA = Path(__file__).parents[1] / "data"
MATH = DATA / "math_tiny.jsonl"
FIELDS = dict(prompt_key="question", answer_key="solution.answer", metadata_keys=("id",))


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _data(tok, path=MATH, **kw) -> PromptDataset:
    return PromptDataset(path, tok, **(FIELDS | dict(max_prompt_len=96, seed=3) | kw))


def test_field_mapping_and_chat_template(tok):
    data = _data(tok)
    first = data.prompts[0]
    assert tok.decode(first.ids.tolist()) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert (first.answer, first.metadata, first.row) == ("5", {"id": "t0"}, 0)
    plain = _data(tok, chat_template=False)
    assert tok.decode(plain.prompts[0].ids.tolist()) == "What is 2+3?"
    system = _data(tok, system_prompt="Put the answer in \\boxed{}.")
    assert tok.decode(system.prompts[0].ids.tolist()).startswith("<|im_start|>system\nPut the answer in \\boxed{}.")
    with pytest.raises(DatasetError, match=r"prompt_key=.prompt.: row 0 of .* has no field .prompt. \(its keys: "):
        _data(tok, prompt_key="prompt")


def test_messages_prompt_and_parquet_read_the_same(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_rows(MATH)
    for r in rows:
        r["question"] = [{"role": "user", "content": r["question"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet")
    parquet = _data(tok, tmp_path / "math.parquet")
    jsonl = _data(tok)
    assert [p.ids.tolist() for p in parquet.prompts] == [p.ids.tolist() for p in jsonl.prompts]
    assert [p.answer for p in parquet.prompts] == [p.answer for p in jsonl.prompts]


def test_length_filter_counts_what_it_drops(tok):
    lengths = sorted(len(p.ids) for p in _data(tok).prompts)
    cut = _data(tok, max_prompt_len=lengths[3])
    assert cut.size == sum(n <= lengths[3] for n in lengths) and cut.filtered == 8 - cut.size
    assert cut.max_prompt_len <= lengths[3]
    with pytest.raises(ValueError, match="no prompt of at most 3 tokens"):
        _data(tok, max_prompt_len=3)


def test_epochs_are_seeded_permutations_and_resume_continues_at_the_right_sample(tok):
    data = _data(tok)
    rows = [p.row for step in range(8) for p in data.batch(step, 3)]  # 24 samples = 3 epochs of 8
    epochs = [rows[0:8], rows[8:16], rows[16:24]]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # every prompt once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert data.position(5, 3) == (1, 7)
    again = _data(tok)  # a resumed run: a fresh dataset object, the same steps
    assert [p.row for p in again.batch(5, 3)] == rows[15:18]
    assert [p.row for p in _data(tok, seed=4).batch(0, 8)] != epochs[0]
    assert [p.row for p in _data(tok, shuffle=False).batch(1, 3)] == [3, 4, 5]


def test_addition_is_one_dataset_with_the_exact_match_reward():
    data, task = AdditionData(2, seed=1), AdditionTask(2)
    prompts = data.batch(4, 16)
    operands = task.sample(16, torch.Generator().manual_seed(1 * 7919 + 4))
    assert torch.equal(torch.stack([p.ids for p in prompts]), task.prompts(operands))
    decode = AdditionTokenizer().decode
    answers = task.answers(operands)
    for p, want in zip(prompts, answers, strict=True):
        assert exact_match(decode(want[:-1].tolist()), p.answer, {}) == 1.0  # the reference, EOS stripped
        assert exact_match(decode(want[:-2].tolist()), p.answer, {}) == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("2+3 is \\boxed{5}.", "5", 1.0),
        ("so it is \\boxed{4.5}", "\\frac{9}{2}", 1.0),
        ("\\boxed{\\frac{10}{4}}", "2.5", 1.0),
        ("x = \\boxed{2}", "2", 1.0),
        ("the answer is 5", "5", 0.0),  # no boxed answer
        ("5 or 6? \\boxed{6}", "5", 0.0),
        ("\\boxed{5} then \\boxed{6}", "6", 0.0),  # the first boxed answer counts
        ("\\boxed{12}", None, 0.0),
    ],
)
def test_math_reward(response, answer, reward):
    assert math(response, answer, {}) == reward


def test_reward_loading_by_name_module_and_file(tmp_path):
    assert load_reward("math") is math and load_reward("trace_rl.rewards:exact_match") is exact_match
    (tmp_path / "my_reward.py").write_text("def length(response, answer, metadata):\n    return len(response) / 10\n")
    fn = load_reward(f"{tmp_path}/my_reward.py:length")
    assert fn("abcde", None, {}) == 0.5
    for bad, match in [("nope", "use one of"), ("trace_rl.rewards:nope", "no function nope"), ("x.py:f", "exist")]:
        with pytest.raises(ValueError, match=match):
            load_reward(bad)


@pytest.mark.parametrize(("workers", "kind"), [(0, "thread"), (2, "thread"), (1, "process")])
def test_reward_pools_score_the_same(workers, kind):
    samples = [("\\boxed{5}", "5", {}), ("\\boxed{7}", "5", {}), ("\\boxed{0.5}", "\\frac{1}{2}", {})] * 2
    pool = RewardPool("math", workers, kind)
    try:
        assert [f.result(timeout=300) for f in pool.submit(samples)] == [1.0, 0.0, 1.0] * 2
    finally:
        pool.close()
    with pytest.raises(ValueError, match="reward_pool"):
        RewardPool("math", 1, "fiber")


def test_jsonl_rows_keep_their_fields():
    rows = read_rows(MATH)
    assert len(rows) == 8 and rows[2] == json.loads(MATH.read_text().splitlines()[2])
