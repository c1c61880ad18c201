"""Datasets through the real Hugging Face `datasets`, offline: local files of every format, a
save_to_disk directory, a hub dataset in the local cache; and the seeded epoch sampler."""

from __future__ import annotations

import json

import pytest

from colo_rl.config import ConfigError, DatasetConfig, ToyConfig
from colo_rl.data import DatasetNotAvailableError, PromptSampler, load_split, toy_rows

ROWS = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(10)]


def write(tmp_path, suffix: str):
    import datasets

    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    else:
        ds = datasets.Dataset.from_list(ROWS)
        ds.to_csv(str(path)) if suffix == ".csv" else ds.to_parquet(str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_of_every_format_load_with_their_columns(tmp_path, suffix):
    ds = load_split(DatasetConfig(path=str(write(tmp_path, suffix))), "train", "task.dataset.split")
    assert len(ds) == 10 and set(ds.column_names) == {"question", "answer"}
    assert ds[3]["question"] == "3+1?" and str(ds[3]["answer"]) == "4"


def test_split_slices_and_save_to_disk_directories(tmp_path):
    import datasets

    path = write(tmp_path, ".jsonl")
    assert len(load_split(DatasetConfig(path=str(path)), "train[:80%]", "task.dataset.split")) == 8
    with pytest.raises(ConfigError, match=r"task.dataset.split='test': Unknown split"):
        load_split(DatasetConfig(path=str(path)), "test", "task.dataset.split")
    whole = datasets.Dataset.from_list(ROWS)
    whole.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=whole, test=whole.select(range(2))).save_to_disk(str(tmp_path / "two"))
    assert len(load_split(DatasetConfig(path=str(tmp_path / "one")), "train", "k")) == 10
    assert len(load_split(DatasetConfig(path=str(tmp_path / "two")), "test", "k")) == 2
    with pytest.raises(ConfigError, match="task.dataset.eval_split='valid' is not a split of .*two: it has train, test"):
        load_split(DatasetConfig(path=str(tmp_path / "two")), "valid", "task.dataset.eval_split")


def test_a_missing_path_or_an_unreadable_format_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"task.dataset.path=.*nope.jsonl does not exist"):
        load_split(DatasetConfig(path=str(tmp_path / "nope.jsonl")), "train", "k")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"task.dataset.path=.*data.txt: .txt is not a data file"):
        load_split(DatasetConfig(path=str(tmp_path / "data.txt")), "train", "k")


def test_a_hub_id_missing_from_the_cache_says_how_to_download_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetNotAvailableError, match=r"task.dataset.path=openai/gsm8k is neither a local "
                       r"file .* `hf download --repo-type dataset openai/gsm8k`"):
        load_split(DatasetConfig(path="openai/gsm8k"), "train", "k")


def test_a_hub_dataset_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    """The cache is laid out as `hf download --repo-type dataset` leaves it (refs/main naming
    the snapshot); huggingface_hub resolves it and `datasets` reads the snapshot's files."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "datasets--someone--tiny_math"
    snapshot = repo / "snapshots" / ("a" * 40)
    (snapshot / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    write(tmp_path, ".jsonl").rename(snapshot / "data" / "train.jsonl")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    ds = load_split(DatasetConfig(path="someone/tiny_math"), "train", "k")
    assert len(ds) == 10 and ds[0]["question"] == "0+1?"


def test_epochs_are_seeded_permutations_without_replacement_and_resume_exactly():
    sampler = PromptSampler(5, seed=3)
    drawn = [sampler.next(2) for _ in range(5)]  # 10 rows: two full epochs
    flat = [i for batch in drawn for i in batch]
    assert sorted(flat[:5]) == sorted(flat[5:]) == [0, 1, 2, 3, 4]
    assert flat[:5] != flat[5:]  # a fresh order every epoch
    again = PromptSampler(5, seed=3)
    assert [again.next(2) for _ in range(5)] == drawn
    # a checkpoint in the middle of an epoch: a new sampler continues the same order
    first = PromptSampler(5, seed=3)
    first.next(3)
    state = json.loads(json.dumps(first.state()))  # plain values
    resumed = PromptSampler(5, seed=3)
    resumed.load_state(state)
    assert resumed.next(7) == flat[3:10]
    with pytest.raises(ConfigError, match="task.seed=4: resume with the same task settings"):
        PromptSampler(5, seed=4).load_state(state)


def test_toy_rows_are_reproducible_from_their_seed():
    cfg = ToyConfig(target="a", prompt_len=3, alphabet="xyz")
    rows = toy_rows("target_char", cfg, 5, "train:7")
    assert rows == toy_rows("target_char", cfg, 5, "train:7")
    assert all(len(p) == 4 and p.endswith(":") and set(p[:3]) <= set("xyz") for p in rows["prompt"])
    assert rows["target"] == ["a"] * 5
    copy = toy_rows("copy", ToyConfig(prompt_len=4, alphabet="ab"), 3, "train:0")
    assert [p for p in copy["prompt"]] == [a + "=" for a in copy["answer"]]
