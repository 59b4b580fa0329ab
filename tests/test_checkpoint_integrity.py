"""Checkpoints that verify themselves: every checkpoint-N records its files' sizes and CRC-32s; resume falls back
past one whose bytes changed at the same length; a full disk while saving is one line and leaves no torn folder."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from nlp_tricks import TricksTrainer
from nlp_tricks.runtime.integrity import (
    MANIFEST_NAME,
    NO_SPACE_EXIT_CODE,
    NoSpaceLeftError,
    is_disk_full,
    is_temporary_file,
    manifest_problem,
    write_manifest,
)
from nlp_tricks.runtime.resume import CheckpointResumeError, checkpoint_problem, get_last_complete_checkpoint
from recipe_helpers import ROOT, env, ner_files, tiny_args
from tiny import bert_seq_cls, seq_cls_data, tricks_args

STEPS = 4


def _trainer(out, **overrides) -> TricksTrainer:
    settings = dict(max_steps=STEPS, save_strategy="steps", save_steps=2, train_sampling_strategy="sequential")
    settings.update(overrides)
    return TricksTrainer(model=bert_seq_cls(), args=tricks_args(out, **settings), train_dataset=seq_cls_data(n=16))


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _flip_bytes_in_the_middle(path: Path) -> None:
    """Change 64 bytes in the middle of a file, keeping its length: a same-length overwrite or a disk fault."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def test_every_checkpoint_records_each_file_size_and_crc32(tmp_path):
    _trainer(tmp_path).train()
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME)
        assert sorted(manifest["files"]) == files
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(files)
        for name, entry in manifest["files"].items():
            data = (folder / name).read_bytes()
            assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_same_length_corruption_falls_back_to_the_previous_checkpoint(tmp_path, caplog, name):
    reference = _trainer(tmp_path / "reference")
    reference.train()
    out = tmp_path / "run"
    _trainer(out, save_steps=1).train()  # checkpoint-1 ... checkpoint-4
    newest = out / "checkpoint-4"
    _flip_bytes_in_the_middle(newest / name)
    # The header checks alone (a checkpoint without a manifest) accept it: only the checksum sees the change.
    manifest = (newest / MANIFEST_NAME).read_bytes()
    (newest / MANIFEST_NAME).unlink()
    assert checkpoint_problem(newest) is None
    (newest / MANIFEST_NAME).write_bytes(manifest)

    with caplog.at_level(logging.WARNING, logger="nlp_tricks"):
        assert get_last_complete_checkpoint(out) == str(out / "checkpoint-3")
    warning = f"Skipping incomplete checkpoint {newest}: {name} does not match its CRC-32 in {MANIFEST_NAME}"
    assert warning in caplog.text

    resumed = _trainer(out, save_steps=1)
    resumed.train(resume_from_checkpoint=True)  # from checkpoint-3: step 4 again
    want = _weights(reference)
    for key, value in _weights(resumed).items():
        # Same kernels in the same order: any difference is float32 round-off at most.
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-6, msg=key)


def test_a_named_corrupt_checkpoint_is_refused_naming_the_file(tmp_path):
    _trainer(tmp_path, max_steps=2).train()
    _flip_bytes_in_the_middle(tmp_path / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(ValueError, match=r"is incomplete: optimizer\.pt does not match its CRC-32"):
        _trainer(tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_a_checkpoint_without_a_manifest_is_still_accepted(tmp_path):
    """Written before manifests, or by plain Trainer: the header checks alone apply."""
    _trainer(tmp_path).train()
    (tmp_path / "checkpoint-4" / MANIFEST_NAME).unlink()
    assert get_last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")


def _folder(tmp_path) -> Path:
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "a.json").write_text('{"x": 1}')
    (folder / "b.bin").write_bytes(os.urandom(1000))
    (folder / "sub").mkdir()
    (folder / "sub" / "c.pt").write_bytes(os.urandom(10))
    write_manifest(folder)
    return folder


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda f: (f / "b.bin").unlink(), f"b.bin is missing (listed in {MANIFEST_NAME})"),
        (lambda f: (f / "b.bin").write_bytes(b"x"), f"b.bin is 1 bytes where {MANIFEST_NAME} records 1000"),
        (lambda f: (f / "sub" / "c.pt").write_bytes(bytes(10)), "sub/c.pt does not match its CRC-32"),
        (lambda f: (f / "scaler.pt").write_bytes(b"x"), f"scaler.pt is not in {MANIFEST_NAME}"),
        (lambda f: (f / MANIFEST_NAME).write_text('{"files": '), f"{MANIFEST_NAME} is unreadable"),
    ],
)
def test_manifest_problems_name_the_file(tmp_path, change, problem):
    folder = _folder(tmp_path)
    assert manifest_problem(folder) is None
    change(folder)
    assert manifest_problem(folder).startswith(problem)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A run with complete checkpoint-1 and checkpoint-2 (each test changes a copy)."""
    out = tmp_path_factory.mktemp("two") / "run"
    _trainer(out, max_steps=2, save_steps=1).train()
    return out


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(source, target)
    return target


def _forge(change):
    def forge(manifest: dict) -> str:
        change(manifest)
        return json.dumps(manifest)

    return forge


FORGED = {
    "checksum": (_forge(lambda m: m["files"]["optimizer.pt"].update(crc32="0badc0de")), "does not match its CRC-32"),
    # Formerly an OverflowError out of resume (int of an infinite size): no fallback.
    "infinite size": (
        _forge(lambda m: m["files"]["optimizer.pt"].update(size=float("inf"))),  # written as Infinity, read back
        f"{MANIFEST_NAME} is unreadable (the entry of optimizer.pt is not a size and a CRC-32",
    ),
    "a path outside the folder": (
        _forge(lambda m: m["files"].update({"../checkpoint-1/optimizer.pt": m["files"]["optimizer.pt"]})),
        f"{MANIFEST_NAME} is unreadable ('../checkpoint-1/optimizer.pt' is not a path inside the folder)",
    ),
    "an absolute path": (
        _forge(lambda m: m["files"].update({"/etc/hostname": {"size": 1, "crc32": "00000000"}})),
        "is not a path inside the folder",
    ),
    "not a manifest": (lambda m: "[1, 2]", f'{MANIFEST_NAME} is unreadable (not an object with a "files" object)'),
    "another format": (_forge(lambda m: m.update(format=2)), f"{MANIFEST_NAME} is unreadable (format 2 / 'crc32'"),
    "a size of the wrong kind": (
        _forge(lambda m: m["files"]["optimizer.pt"].update(size="1")),
        f"{MANIFEST_NAME} is unreadable (the entry of optimizer.pt is not a size and a CRC-32",
    ),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_manifest_falls_back_to_the_previous_checkpoint(two_checkpoints, tmp_path, caplog, forgery):
    """A manifest that does not match its files, or is not one TricksTrainer writes, is damage like any other:
    resume skips the checkpoint with one warning naming it and takes the previous one; no file outside is read."""
    out = _copy(two_checkpoints, tmp_path)
    path = out / "checkpoint-2" / MANIFEST_NAME
    forge, problem = FORGED[forgery]
    path.write_text(forge(json.loads(path.read_text())))
    with caplog.at_level(logging.WARNING, logger="nlp_tricks"):
        assert get_last_complete_checkpoint(out) == str(out / "checkpoint-1")
    assert f"Skipping incomplete checkpoint {out / 'checkpoint-2'}: " in caplog.text and problem in caplog.text


def test_a_resharded_checkpoint_names_the_way_out_and_resumes_without_its_manifest(two_checkpoints, tmp_path):
    """Weights re-saved in shards on purpose fail the manifest; the refusal says that deleting the manifest resumes
    the checkpoint, and the run resumed that way ends at the uninterrupted run's weights."""
    from transformers import AutoModelForSequenceClassification

    out = _copy(two_checkpoints, tmp_path)
    folder = out / "checkpoint-1"
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()
    problem = checkpoint_problem(folder)
    assert problem == (
        f"model.safetensors is missing (listed in {MANIFEST_NAME}); if the change was yours (the weights re-sharded "
        f"or converted), delete the folder's {MANIFEST_NAME} to resume from it on the header checks alone"
    )
    with pytest.raises(CheckpointResumeError) as info:
        _trainer(out, max_steps=2, save_steps=1).train(resume_from_checkpoint=str(folder))
    assert str(info.value) == f"resume_from_checkpoint={str(folder)!r} is incomplete: {problem}"
    (folder / MANIFEST_NAME).unlink()
    resumed = _trainer(out, max_steps=2, save_steps=1)
    resumed.train(resume_from_checkpoint=str(folder))
    reference = _trainer(tmp_path / "reference", max_steps=2, save_steps=1)
    reference.train()
    want = _weights(reference)
    for key, value in _weights(resumed).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-6, msg=key)  # float32 round-off at most


def test_an_interrupted_saves_temporary_file_never_stays_in_a_checkpoint(tmp_path):
    """A run killed while writing checkpoint-2 leaves safetensors' temporary file there; the resumed run writes
    checkpoint-2 again into the same folder, which must not keep that file nor list it in its manifest."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir(parents=True)
    leftover = folder / ".tmpAb3dE9"  # the name safetensors gives its file while writing it (see the test below)
    leftover.write_bytes(os.urandom(4096))
    (folder / ".checkpoint_manifest.json.tmp").write_text("{")
    _trainer(tmp_path, max_steps=2).train()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
    assert not any(name.startswith(".") for name in json.loads((folder / MANIFEST_NAME).read_text())["files"])
    assert manifest_problem(folder) is None


KILLED_WRITER = """
import sys, torch
from safetensors.torch import save_file
print("writing", flush=True)
save_file({"w": torch.zeros(32 << 20)}, sys.argv[1])
"""


def test_the_temporary_file_safetensors_leaves_when_killed_is_recognised(tmp_path):
    """The real writer, stopped while it writes (then killed, as kill -9 would): what it leaves beside the target is
    what is_temporary_file recognises. safetensors before 0.6 wrote the target itself, with no temporary file."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "model.safetensors")], env=env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "writing"
        names = []
        while proc.poll() is None and not names:
            names = os.listdir(tmp_path)
        proc.send_signal(signal.SIGSTOP)
        names = os.listdir(tmp_path)
    finally:
        proc.kill()
        proc.wait()
    if names == ["model.safetensors"] or not names:
        pytest.skip(f"this safetensors writes its target directly, or finished first: {names}")
    assert len(names) == 1 and is_temporary_file(names[0]), names


# ---- A full disk -----------------------------------------------------------------------------------------------


def test_full_disk_while_saving_is_one_line_and_leaves_no_torn_checkpoint(tmp_path, monkeypatch):
    """The optimizer's file of checkpoint-4 hits a full disk half-way (a patched writer, as torch.save would)."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith(os.path.join("checkpoint-4", "optimizer.pt")):
            with open(f, "wb") as handle:
                handle.write(b"PK\x03\x04" + bytes(100))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    trainer = _trainer(tmp_path)
    with pytest.raises(NoSpaceLeftError) as info:
        trainer.train()
    message = str(info.value)
    assert message.startswith("no space left on device while writing checkpoint-4/optimizer.pt (")
    assert "\n" not in message and info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert get_last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")


# safetensors' own error on a full disk (its writer is in Rust), as a final save outside checkpoint-N meets it.
FULL_AT_THE_FINAL_SAVE = """
import os, runpy, sys
import safetensors
import transformers.modeling_utils as modeling

real = modeling.safe_save_file

def save(tensors, filename, metadata=None):
    if "checkpoint-" not in str(filename):
        raise safetensors.SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )
    return real(tensors, filename, metadata=metadata)

modeling.safe_save_file = save
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python recipes/ner.py` puts the recipes' folder first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_full_disk_at_the_final_save_is_one_line_exit_74_and_leaves_no_model(tiny_model, tmp_path):
    """Formerly exit 1 with a traceback, and the final folder kept the files written before the weights (config,
    tokenizer): now one line, exit 74, nothing of that save left, the checkpoints intact."""
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--save_steps", "1")
    command = [sys.executable, "-c", FULL_AT_THE_FINAL_SAVE, str(ROOT / "recipes" / "ner.py"), *args]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == NO_SPACE_EXIT_CODE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("no space left on device")]
    assert lines == [
        f"no space left on device while writing the final model, {out / 'model.safetensors'} ("
        + lines[0].split(" (", 1)[1]
    ], proc.stderr[-3000:]
    assert lines[0].endswith(
        "free); the files of that save were removed and the checkpoints are intact: free some space and rerun with "
        "--resume_from_checkpoint true"
    )
    left = sorted(p.name for p in out.iterdir())
    assert not {"model.safetensors", "config.json", "tokenizer.json", "all_results.json"} & set(left), left
    assert get_last_complete_checkpoint(out) == str(out / "checkpoint-2")


def test_a_named_corrupt_checkpoint_is_one_line_and_exit_1_in_a_recipe(tiny_model, tmp_path, monkeypatch):
    """Formerly a ValueError traceback."""
    from recipe_helpers import run_in_process

    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--save_steps", "1")
    assert run_in_process("ner", args, monkeypatch) == 0
    named = out / "checkpoint-2"
    _flip_bytes_in_the_middle(named / "optimizer.pt")
    again = [*args, "--max_steps", "3", "--resume_from_checkpoint", str(named)]
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "ner.py"), *again], cwd=ROOT, env=env(),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("resume_from_checkpoint=")]
    problem = f"optimizer.pt does not match its CRC-32 in {MANIFEST_NAME}"
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"resume_from_checkpoint={str(named)!r} is incomplete: {problem}")
    assert not (out / "all_results.json").exists() and not (out / "checkpoint-3").exists()


def test_other_save_errors_pass_unchanged(tmp_path, monkeypatch):
    def save(obj, f, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(f))

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(PermissionError):
        _trainer(tmp_path, max_steps=2).train()
    assert (tmp_path / "checkpoint-2").is_dir()  # left for the header checks to judge, as a crash leaves it


@pytest.mark.parametrize(
    "error, full",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: ... })"), True),
        (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4054"), False),
        (OSError(errno.EACCES, "Permission denied"), False),
    ],
)
def test_disk_full_is_read_from_the_errno_or_the_message(tmp_path, error, full):
    # A bare "unexpected pos" (torch's writer) counts only when the disk has less than 16 MiB free: not here.
    assert is_disk_full(error, tmp_path) is full


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    where.mkdir(exist_ok=True)
    probe = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.slow  # a recipe process: ~30 s on 2 shared cores
def test_recipe_on_a_really_full_disk_exits_74_with_one_line(tiny_model, tmp_path):
    """A 1 MB tmpfs (a user namespace's own mount, no root needed) holds two checkpoints of the tiny BERT, not
    three: safetensors' and torch's real writers fail on it."""
    disk = tmp_path / "disk"
    if not _can_mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    out = disk / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--max_steps", "6", "--save_steps", "1")
    recipe = " ".join([sys.executable, str(ROOT / "recipes" / "ner.py"), *args])
    # The files the run reports on are read inside the namespace, before the tmpfs goes with it.
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {disk} && {recipe}; code=$?; "
        f"ls {out} > {tmp_path}/listing.txt; echo $code > {tmp_path}/code.txt"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True)
    code = int((tmp_path / "code.txt").read_text())
    assert code == NO_SPACE_EXIT_CODE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("no space left on device while writing")]
    assert len(lines) == 1, proc.stderr[-3000:]
    step = int(lines[0].split("checkpoint-")[1].split("/")[0])
    listing = (tmp_path / "listing.txt").read_text().split()
    assert f"checkpoint-{step}" not in listing and f"checkpoint-{step - 1}" in listing
    assert "all_results.json" not in listing and "model.safetensors" not in listing


def test_no_space_exit_code_is_documented():
    assert f"`{NO_SPACE_EXIT_CODE}`" in (ROOT / "docs" / "checkpoints.md").read_text()


def test_checksum_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint_checksum.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"].split()[0]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"save", "crc32", "read", "blake2b", "sha256"}
    assert rows["save"]["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in rows.values())
