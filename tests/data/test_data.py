import json

import pytest
import torch

from gcore.data import DataConfig, PromptSampler, load_eval_prompts, load_prompts, read_rows
from gcore.errors import DataError
from gcore.model import char_tokenizer
from gcore.tasks import mixed_rows
from gcore.types import Prompt, Sample, collate


def test_collate_aligns_response_mask_with_next_token_logprobs():
    prompt = Prompt(0, "ab", [10, 11])
    samples = [
        Sample(prompt, 0, [12, 13, 2], [-0.1, -0.2, -0.3], "cd", True),
        Sample(prompt, 0, [14], [-0.5], "e", False),
    ]
    batch = collate(samples, pad_id=0, temperature=1.0)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 2], [10, 11, 14, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t+1: the response starts at t = len(prompt) - 1
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    assert batch.engine_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3])
    trimmed = batch.select(torch.tensor([1]))
    assert trimmed.input_ids.tolist() == [[10, 11, 14]] and trimmed.response_mask.tolist() == [[0, 1]]


def test_sampler_deals_each_prompt_once_per_epoch_across_ranks():
    seen = []
    samplers = [PromptSampler(10, per_step=5, rank=r, world_size=2, seed=3, shuffle=True) for r in range(2)]
    for _ in range(2):  # two steps = one epoch of 10 prompts
        shards = [s.shard(s.next_global()) for s in samplers]
        assert len(shards[0]) == 3 and len(shards[1]) == 2  # 5 does not divide by 2
        seen.extend(shards[0] + shards[1])
    assert sorted(seen) == list(range(10))
    state = samplers[0].state_dict()
    fresh = PromptSampler(10, per_step=5, rank=0, world_size=2, seed=3, shuffle=True)
    fresh.load_state_dict(state)
    assert fresh.next_global() == samplers[0].next_global()


def test_peeking_at_the_next_batch_does_not_draw_it():
    """``peek_global`` (what a placement predicts the next rollout from) is the next ``next_global``, across an
    epoch's end, and leaves the stream where it was."""
    sampler = PromptSampler(10, per_step=4, rank=0, world_size=1, seed=3, shuffle=True)
    reference = PromptSampler(10, per_step=4, rank=0, world_size=1, seed=3, shuffle=True)
    for _ in range(4):  # the third batch spans two epochs
        peeked = sampler.peek_global()
        assert sampler.peek_global() == peeked == sampler.next_global() == reference.next_global()
    assert sampler.state_dict() == reference.state_dict()


def test_sampler_state_moves_to_another_rank_count_and_checks_the_dataset():
    two = [PromptSampler(10, per_step=4, rank=r, world_size=2, seed=3, shuffle=True) for r in range(2)]
    for _ in range(3):  # into the second epoch
        for sampler in two:
            sampler.shard(sampler.next_global())
    one = PromptSampler(10, per_step=4, rank=0, world_size=1, seed=3, shuffle=True)
    one.load_state_dict(two[0].state_dict())
    expected = two[0].next_global()
    assert one.next_global() == expected and one.shard(expected) == expected  # the global stream goes on
    other_dataset = PromptSampler(12, per_step=4, rank=0, world_size=1, seed=3, shuffle=True)
    with pytest.raises(DataError, match="over 10 prompts, this run has 12"):
        other_dataset.load_state_dict(two[0].state_dict())


def test_sampler_rejects_fewer_prompts_than_controllers():
    with pytest.raises(DataError, match="smaller than the 4 controllers"):
        PromptSampler(10, per_step=2, rank=0, world_size=4, seed=0, shuffle=False)


def test_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "1+1=", "solution": 2}, {"question": "2+2=", "solution": 4}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    config = DataConfig(prompt_key="question", answer_key="solution", prompt_template="Q:{prompt}")
    for path in (jsonl, parquet):
        config.path = str(path)
        prompts = load_prompts(config, char_tokenizer(), max_new_tokens=4, context=64)
        assert [p.text for p in prompts] == ["Q:1+1=", "Q:2+2="] and [p.answer for p in prompts] == ["2", "4"]
        assert prompts[1].source.startswith(str(path))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n{"prompt": \n', r"d\.jsonl:2: malformed JSON line"),
        ('{"prompt": "a"}\n[1, 2]\n', r"d\.jsonl:2: expected a JSON object"),
        ('{"text": "a"}\n', r"d\.jsonl:1: no 'prompt' key \(keys: text\)"),
        ("", "the dataset is empty"),
        ('{"prompt": "' + "x" * 100 + '"}\n', r"d\.jsonl:1: prompt of 100 tokens \+ 4 new tokens exceeds"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_prompts(DataConfig(path=str(path)), char_tokenizer(), max_new_tokens=4, context=64)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a")
    with pytest.raises(DataError, match="unknown format"):
        read_rows(str(tmp_path / "d.csv"))


def test_saved_datasets_folder_and_chat_template(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    tokenizer = char_tokenizer()
    prompts = load_prompts(DataConfig(path=str(tmp_path / "ds")), tokenizer, max_new_tokens=4, context=64)
    assert [p.text for p in prompts] == ["1+1=", "2+2="] and prompts[1].source.endswith("ds:row 2")
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        load_prompts(DataConfig(path=str(tmp_path / "ds"), chat_template=True), tokenizer, 4, 64)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>"
    prompts = load_prompts(DataConfig(path=str(tmp_path / "ds"), chat_template=True), tokenizer, 4, 64)
    assert prompts[0].text == "<user>1+1=>" and tokenizer.decode(prompts[0].token_ids) == "<user>1+1=>"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a folder saved with datasets"):
        load_prompts(DataConfig(path=str(tmp_path / "empty")), tokenizer, 4, 64)


def test_invalid_utf8_names_the_file_and_line(tmp_path):
    # before: "cannot read: 'utf-8' codec can't decode byte 0xe9 in position 27" (a byte offset, no line)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\r\n{"prompt": "also fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"^\S+d\.jsonl:3: not valid UTF-8 \(byte 0xe9 at character 16\); save the "
                                        r"file as UTF-8$"):
        read_rows(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n')  # valid UTF-8, with a byte order mark
    assert [row for row, _ in read_rows(str(path))] == [{"prompt": "café"}]


def test_a_data_path_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path):
    import os
    import threading

    # before: a named pipe was opened and read (blocking until a writer came); here a writer is waiting
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:  # blocks until the pipe is opened for reading
            f.write('{"prompt": "from a pipe"}\n')

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        with pytest.raises(DataError, match=r"^--data.path \S+d\.jsonl: a named pipe, not a regular file; give a "):
            read_rows(str(fifo))
    finally:  # let the writer finish
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(reader)
    device = tmp_path / "dev.jsonl"
    device.symlink_to("/dev/null")
    with pytest.raises(DataError, match=r"dev\.jsonl: a character device, not a regular file"):
        read_rows(str(device))


def test_metadata_keys_are_copied_from_each_row_and_a_missing_one_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+1=", "answer": "2", "data_source": "math", "level": 1},
            {"prompt": "a poem", "data_source": "judge", "level": 3}]
    jsonl, parquet = tmp_path / "d.jsonl", tmp_path / "d.parquet"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        config = DataConfig(path=str(path), metadata_keys=["data_source", "level"])
        prompts = load_prompts(config, char_tokenizer(), max_new_tokens=4, context=64)
        assert [p.metadata for p in prompts] == [{"data_source": "math", "level": 1},
                                                 {"data_source": "judge", "level": 3}]
    assert load_prompts(DataConfig(path=str(jsonl)), char_tokenizer(), 4, 64)[0].metadata == {}  # none asked for
    jsonl.write_text('{"prompt": "a", "data_source": "math"}\n{"prompt": "b"}\n')
    with pytest.raises(DataError, match=r"^\S+d\.jsonl:2: no 'data_source' key \(keys: prompt\) named in "
                                        r"--data.metadata_keys$"):
        load_prompts(DataConfig(path=str(jsonl), metadata_keys=["data_source"]), char_tokenizer(), 4, 64)


def test_the_mixed_task_judged_share_rises_along_the_prompts_order():
    config = DataConfig(task="mixed", task_judged_share=(0.1, 0.9), num_synthetic_prompts=400, shuffle=False,
                        prompts_per_step=40)
    prompts = load_prompts(config, char_tokenizer(), max_new_tokens=4, context=None)
    judged = [p.metadata["reward"] == "judge" for p in prompts]
    assert {p.metadata["reward"] for p in prompts} == {"math", "judge"}
    # a judged prompt has no answer
    assert all((p.answer is None) == is_judged for p, is_judged in zip(prompts, judged, strict=True))
    assert prompts[0].text.startswith("Which number is") and prompts[0].source == "<mixed:train>:1"
    # the sampler keeps the order without shuffle: the first step's share is about 0.1, the last's about 0.9
    sampler = PromptSampler(len(prompts), config.prompts_per_step, rank=0, world_size=1, seed=0, shuffle=False)
    steps = [sampler.next_global() for _ in range(10)]
    shares = [sum(judged[i] for i in step) / len(step) for step in steps]
    assert shares[0] == pytest.approx(0.14, abs=0.03) and shares[-1] == pytest.approx(0.86, abs=0.03), shares
    assert shares == sorted(shares)
    assert sum(judged) == 200  # the mean share, 0.5, over the whole dataset
    flat = load_prompts(DataConfig(task="mixed", task_judged_share=(1.0, 1.0), num_synthetic_prompts=20),
                        char_tokenizer(), 4, None)
    assert all(p.metadata == {"reward": "judge"} for p in flat)


def test_mixed_rows_are_deterministic_and_the_test_split_is_held_out():
    half = (0.5, 0.5)
    rows = mixed_rows(300, judged_share=half)
    assert rows == mixed_rows(300, judged_share=half) and rows != mixed_rows(300, seed=1, judged_share=half)
    test = mixed_rows(100, split="test", judged_share=half)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test}
    config = DataConfig(task="mixed", num_eval_prompts=8, metadata_keys=["answer"])
    with pytest.raises(DataError, match=r"<mixed:test>:\d+: no 'answer' key .* named in --data.metadata_keys"):
        load_eval_prompts(config, char_tokenizer(), 4, None)  # a judged row has no answer
    with pytest.raises(DataError, match=r"--data.task_judged_share \[0.1, 1.5\]: both shares must be within"):
        load_prompts(DataConfig(task="mixed", task_judged_share=(0.1, 1.5)), char_tokenizer(), 4, None)
