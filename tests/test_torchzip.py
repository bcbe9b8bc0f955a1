"""metaseq.torchzip: torch's checkpoint format read and written without torch, checked against torch itself."""
import argparse
import codecs
import collections
import errno
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from metaseq import torchzip
from metaseq.errors import CheckpointLoadError
from metaseq.torchzip import Copy, NeedsTorch, Opaque, Size, TensorRef, read_checkpoint, write_checkpoint
from synthetic import make_model, make_shards, write_shards


def read_structure(path: str):
    return read_checkpoint(path)[0]


def _sample() -> dict:
    base = torch.arange(24, dtype=torch.float32) * 0.5 - 3
    tied = torch.randn(5, 3)
    model = collections.OrderedDict(weight=tied, tied=tied, version=torch.tensor([7.0]))
    model._metadata = {"": {"version": 1}}  # what nn.Module.state_dict() sets, pickled with BUILD
    return {
        "model": model,
        "views": [base[3:9], base.view(4, 6)[:, 1:3], base],  # offset and non-contiguous views of one storage
        "scalars": {"step": torch.tensor(12, dtype=torch.int64), "half": torch.tensor(1.5, dtype=torch.float16),
                    "bf": torch.tensor(-2.25, dtype=torch.bfloat16), "flag": torch.tensor(True)},
        "dtypes": [torch.zeros(3, dtype=d) + 1 for d in (torch.float64, torch.int32, torch.int16, torch.int8,
                                                          torch.uint8, torch.bfloat16, torch.float16)],
        "empty": torch.zeros(0, 4),
        "meta": {"shapes": [torch.Size([5, 3]), torch.Size([])], "numels": [15, 1], "names": ["a.b", "ü✓"]},
        "numbers": [0, 255, 256, 65535, 65536, -1, -(2**31), 2**31, 2**70, -(2**70), 1.5, float("inf"), True, False],
        "nested": (None, ("x", (1, 2, 3, 4)), [], {}, ()),
        "dtype": torch.float32,
    }


def _assert_same(a, b, path="") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if torch.is_tensor(a):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert vars(a) == vars(b) if isinstance(a, collections.OrderedDict) else True, path
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def _rewrite(src: Path, dst: Path) -> None:
    structure = read_structure(str(src))
    with open(dst, "wb") as f:
        size = write_checkpoint(f.fileno(), structure)
    assert size == dst.stat().st_size


@pytest.mark.parametrize("mmap", [False, True])
def test_rewritten_checkpoint_loads_in_torch_as_the_original(tmp_path: Path, mmap: bool) -> None:
    original = _sample()
    torch.save(original, tmp_path / "in.pt")
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True, mmap=mmap)
    _assert_same(original, loaded)
    # Tied tensors stay one object; views keep sharing one storage.
    assert loaded["model"]["weight"] is loaded["model"]["tied"]
    pointers = {v.untyped_storage().data_ptr() for v in loaded["views"]}
    assert len(pointers) == 1


@pytest.mark.parametrize("big", [False, True])
def test_torch_can_compute_the_record_offsets_from_the_layout(tmp_path: Path, monkeypatch, big: bool) -> None:
    """torch.load may compute where each storage's data lies from miniz's layout (data descriptors, zip64 fields)
    instead of reading every local header; TORCH_SERIALIZATION_DEBUG makes it check them against the headers.
    `big`: a 4 GiB storage first (never written, so the file is sparse), so the records after it are zip64."""
    import torch.utils.serialization.config as serialization_config

    original = _sample()
    torch.save(original, tmp_path / "in.pt")
    obj = read_structure(str(tmp_path / "in.pt"))
    if big:
        obj = {"big": TensorRef.empty([2**32 + 8], torchzip.dtype_by_name("uint8")), **obj}
    with open(tmp_path / "out.pt", "wb") as f:
        write_checkpoint(f.fileno(), obj)
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with serialization_config.patch({"load.calculate_storage_offsets": True}):
        loaded = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert loaded.pop("big").shape == (2**32 + 8,) if big else "big" not in loaded
    _assert_same(original, loaded)


def test_the_pickle_is_byte_for_byte_the_one_torch_save_writes(tmp_path: Path) -> None:
    """Both are Python's pickler at protocol 2: the same opcodes, memo and batches (lists of over 1000)."""
    original = {**_sample(), "blob": b"\x00\x01", "no_bytes": b"", "many": list(range(2500)), "one": ["x"],
                "args": argparse.Namespace(lr=1.0, betas=(0.9, 0.98))}
    torch.save(original, tmp_path / "in.pt")
    with zipfile.ZipFile(tmp_path / "in.pt") as archive:
        expected = archive.read("in/data.pkl")
    obj = read_structure(str(tmp_path / "in.pt"))
    assert obj["no_bytes"] == b"" and torchzip.pickle_bytes(obj) == expected
    with pytest.raises(TypeError, match="cannot write a Tensor"):  # torch objects are not written by mistake
        torchzip.pickle_bytes({"w": torch.zeros(1)})


def test_reading_touches_only_the_pickle(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(1000, dtype=torch.int64)[10:20]}, tmp_path / "in.pt")
    ref = read_structure(str(tmp_path / "in.pt"))["w"]
    assert isinstance(ref, TensorRef) and ref.shape == Size([10]) and ref.dtype.name == "int64"
    assert ref.storage_offset == 10 and ref.storage.nbytes == 8000 and ref.is_contiguous()
    assert ref.compact().storage.nbytes == 80 and ref.compact().storage.locate(0) == ref.storage.locate(10)
    torch.save({"step": torch.tensor([[-5]]), "bf": torch.tensor(0.375, dtype=torch.bfloat16)}, tmp_path / "s.pt")
    scalars = read_structure(str(tmp_path / "s.pt"))
    assert scalars["step"].compact(()).shape == () and scalars["step"].value() == -5 and scalars["bf"].value() == 0.375
    assert repr(ref.shape) == "torch.Size([10])" and repr(ref.dtype) == "torch.int64"


def test_records_are_aligned_like_torch_writes_them(tmp_path: Path) -> None:
    torch.save(_sample(), tmp_path / "in.pt")
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    with open(tmp_path / "out.pt", "rb") as f, zipfile.ZipFile(f) as archive:
        names = archive.namelist()
        assert names[0] == "archive/data.pkl" and "archive/byteorder" in names and "archive/version" in names
        for info in archive.infolist():
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<26xHH", f.read(30))
            assert (info.header_offset + 30 + name_len + extra_len) % torchzip.ALIGNMENT == 0, info.filename
            assert info.compress_type == zipfile.ZIP_STORED
        assert archive.read("archive/byteorder") == b"little"  # small records carry real CRC32s


def test_zip64_fields_are_read_by_torch_and_zipfile(tmp_path: Path, monkeypatch) -> None:
    """Records of 4 GiB and more need zip64 fields; forced here on small records by lowering the limit."""
    original = _sample()
    torch.save(original, tmp_path / "in.pt")
    monkeypatch.setattr(torchzip, "ZIP64_LIMIT", 16)
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    with zipfile.ZipFile(tmp_path / "out.pt") as archive:
        assert archive.read("archive/version") == b"3\n"
        assert any(info.file_size >= 16 for info in archive.infolist())
    assert b"\x01\x00\x10\x00" in (tmp_path / "out.pt").read_bytes()  # a zip64 extra field in a local header
    _assert_same(original, torch.load(tmp_path / "out.pt", weights_only=True, mmap=True))


def test_copy_falls_back_to_read_and_write_where_the_kernel_cannot(tmp_path: Path, monkeypatch) -> None:
    original = _sample()
    torch.save(original, tmp_path / "in.pt")

    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    _assert_same(original, torch.load(tmp_path / "out.pt", weights_only=True))


def test_pieces_and_zero_padding_fill_a_new_tensor(tmp_path: Path) -> None:
    torch.save({"a": torch.arange(10, dtype=torch.float32)}, tmp_path / "in.pt")
    src = read_structure(str(tmp_path / "in.pt"))["a"]
    out = TensorRef.empty([2, 4], torchzip.dtype_by_name("float32"))
    path, offset = src.storage.locate(6)
    out.storage.copies.append(Copy(path, offset, 4, 3, src.dtype))  # elements 6..8 into positions 1..3; the rest zeros
    with open(tmp_path / "out.pt", "wb") as f:
        write_checkpoint(f.fileno(), {"x": out})
    expected = torch.tensor([[0, 6, 7, 8], [0, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["x"], expected)


@pytest.mark.parametrize("cast", [False, True], ids=["copied", "cast"])
def test_a_source_that_ends_before_its_copy_is_named(tmp_path: Path, cast: bool) -> None:
    """Cut short after it was read (another process): the copy names it, the kernel's and the cast's alike."""
    torch.save({"a": torch.arange(1000, dtype=torch.float32)}, tmp_path / "in.pt")
    src = read_structure(str(tmp_path / "in.pt"))["a"]
    path, offset = src.storage.locate(0)
    out = TensorRef.empty([1000], torchzip.dtype_by_name("float16" if cast else "float32"))
    out.storage.copies.append(Copy(path, offset, 0, 1000, src.dtype))
    os.truncate(path, offset + 400)
    with open(tmp_path / "out.pt", "wb") as f, pytest.raises(CheckpointLoadError) as error:
        write_checkpoint(f.fileno(), {"x": out})
    assert str(error.value) == (f"{path} ended early while being read (another process changed it?); rerun once "
                                "nothing writes to it")


@pytest.mark.parametrize("window", [torchzip.WINDOW_BYTES, 100])
def test_rows_and_many_copies_are_gathered_window_by_window(tmp_path: Path, monkeypatch, window: int) -> None:
    """Model-parallel cuts: a column block of a weight (one repeating copy, cast on the way) and two
    weights side by side (two repeating copies) gathered over many windows; the same two weights as a
    copy per row (gathered in one window, or copied file to file when the storage exceeds one)."""
    monkeypatch.setattr(torchzip, "WINDOW_BYTES", window)
    w, v = torch.randn(37, 10), torch.randn(37, 6)
    torch.save({"w": w, "v": v}, tmp_path / "in.pt")
    src = read_structure(str(tmp_path / "in.pt"))
    (path, w_at), (_, v_at) = src["w"].storage.locate(0), src["v"].storage.locate(0)
    f32, f64 = torchzip.dtype_by_name("float32"), torchzip.dtype_by_name("float64")
    columns = TensorRef.empty([38, 4], f64)  # W[:, 3:7] as float64, and a zero row
    columns.storage.copies.append(Copy(path, w_at + 12, 0, 4, f32, count=37, src_stride=40))
    joined = TensorRef.empty([37, 16], f32)  # [W | V], row by row
    for r in range(37):
        joined.storage.copies += [Copy(path, w_at + 40 * r, 64 * r, 10, f32),
                                  Copy(path, v_at + 24 * r, 64 * r + 40, 6, f32)]
    side = TensorRef.empty([37, 16], f32)  # [W | V] again: two repeating copies, their rows side by side
    side.storage.copies += [Copy(path, v_at, 40, 6, f32, count=37, src_stride=24, dst_stride=64),
                            Copy(path, w_at, 0, 10, f32, count=37, src_stride=40, dst_stride=64)]
    with open(tmp_path / "out.pt", "wb") as f:
        write_checkpoint(f.fileno(), {"columns": columns, "joined": joined, "side": side})
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["columns"], torch.cat([w[:, 3:7].double(), torch.zeros(1, 4, dtype=torch.float64)]))
    assert torch.equal(out["joined"], torch.cat([w, v], dim=1))
    assert torch.equal(out["side"], torch.cat([w, v], dim=1))


def _legacy(path: Path) -> None:
    torch.save({"a": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)


def test_legacy_files_are_left_to_torch(tmp_path: Path) -> None:
    _legacy(tmp_path / "in.pt")
    with pytest.raises(NeedsTorch):
        read_structure(str(tmp_path / "in.pt"))


def test_legacy_files_of_pickle_protocol_4_name_the_protocol_and_the_fix(tmp_path: Path) -> None:
    """torch's safe loader reads no protocol 4 pickle: one line that says so (no torch warning), not "corrupt"."""
    shards = make_shards(make_model(), 2)
    for r, shard in enumerate(shards):
        torch.save(shard, tmp_path / f"s{r}.pt", _use_new_zipfile_serialization=False, pickle_protocol=4)
    argv = [sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input", str(tmp_path / "s*.pt"), "--quiet",
            "--output", str(tmp_path / "out" / "o{i}.pt"), "--num-output-shards", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == (
        f"ERROR: {tmp_path / 's0.pt'}: torch's safe loader cannot read its pickle (opcode 149: saved with pickle "
        "protocol 4 or later?); if you trust this file, pass --trust-checkpoint, or save it again with torch.save's "
        "default protocol\n")
    assert not (tmp_path / "out").exists()
    assert subprocess.run([*argv, "--trust-checkpoint"], capture_output=True).returncode == 0


def _damaged_pickle(path: Path) -> None:
    torch.save({"a": torch.zeros(2), "name": "x" * 50}, path)
    data = bytearray(path.read_bytes())
    data[data.index(b"x" * 50) + 3] ^= 1  # inside data.pkl: its CRC32 no longer matches
    path.write_bytes(bytes(data))


def _truncated(path: Path) -> None:
    torch.save({"a": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:2000])


@pytest.mark.parametrize("make, words", [(_damaged_pickle, "record data.pkl fails its CRC32 check"),
                                         (_truncated, "no zip directory at its end, so it is truncated")],
                         ids=["damaged-pickle", "truncated"])
def test_damaged_files_are_refused_not_misread(tmp_path: Path, make, words: str) -> None:
    make(tmp_path / "in.pt")
    with pytest.raises(CheckpointLoadError, match=words):
        read_structure(str(tmp_path / "in.pt"))


class Outer:
    class Inner:  # a nested class: pickled by qualified name
        def __init__(self, v: int) -> None:
            self.v = v

        def __eq__(self, other: object) -> bool:
            return type(other) is Outer.Inner and other.v == self.v


class Point:
    """A class the reader does not know: carried as its pickle built it."""

    def __init__(self, x: int) -> None:
        self.x, self.items = x, [torch.arange(3)]

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and other.x == self.x and torch.equal(other.items[0], self.items[0])


def test_objects_of_other_classes_are_carried_and_written_back_equal(tmp_path: Path) -> None:
    original = {"args": argparse.Namespace(lr=1.0, betas=(0.9, 0.98)), "p": Point(3), "blob": b"\x00\x01",
                "kinds": {1, 2}, "a": torch.zeros(2)}
    torch.save(original, tmp_path / "in.pt")
    obj, unknown = read_checkpoint(str(tmp_path / "in.pt"))
    assert unknown == ["__builtin__.set", "argparse.Namespace", "test_torchzip.Point"]  # protocol 2 names
    assert isinstance(obj["p"], Opaque) and obj["blob"] == b"\x00\x01"
    with open(tmp_path / "out.pt", "wb") as f:
        write_checkpoint(f.fileno(), obj)
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert loaded.keys() == original.keys() and loaded["args"] == original["args"] and loaded["p"] == original["p"]
    assert loaded["blob"] == original["blob"] and loaded["kinds"] == original["kinds"]


class Keyword:
    """Made with keyword arguments: protocol 2 pickles a call of functools.partial(Keyword.__new__, ...)."""

    def __new__(cls, a: int, *, b: int) -> "Keyword":
        obj = object.__new__(cls)
        obj.a, obj.b = a, b
        return obj

    def __getnewargs_ex__(self) -> tuple[tuple, dict]:
        return (self.a,), {"b": self.b}

    def __eq__(self, other: object) -> bool:
        return type(other) is Keyword and (other.a, other.b) == (self.a, self.b)


def test_globals_of_the_format_held_as_values_are_written_back_as_those_globals(tmp_path: Path) -> None:
    """A tensor with attributes is pickled as a call given the function `_rebuild_tensor_v2` itself; classes and
    functions the reader resolves may also be plain values."""
    tagged = torch.arange(4.0)
    tagged.note = "kept"
    original = {"tagged": tagged, "classes": [torch.Size, torch.FloatStorage, torch.float16], "encode": codecs.encode}
    torch.save(original, tmp_path / "in.pt")
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert torch.equal(loaded["tagged"], tagged) and loaded["tagged"].note == "kept"
    assert loaded["classes"][0] is torch.Size and loaded["classes"][2] is torch.float16
    assert loaded["classes"][1].dtype == torch.float32 and loaded["encode"] is codecs.encode
    assert torch.load(tmp_path / "out.pt", weights_only=True)["classes"][0] is torch.Size


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_objects_made_with_keyword_arguments_are_carried_not_called_corrupt(tmp_path: Path, protocol: int) -> None:
    """Protocol 4 and later make them with NEWOBJ_EX, which torch's safe loader cannot read: written back so."""
    torch.save({"k": [Keyword(5, b=7)] * 2, "a": torch.zeros(2)}, tmp_path / "in.pt", pickle_protocol=protocol)
    obj, unknown = read_checkpoint(str(tmp_path / "in.pt"))
    assert ("functools.partial" in unknown) == (protocol == 2) and isinstance(obj["k"][0], Opaque)
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert loaded["k"] == [Keyword(5, b=7)] * 2 and loaded["k"][0] is loaded["k"][1] and torch.equal(loaded["a"],
                                                                                                     torch.zeros(2))


def test_parameters_are_read_as_their_tensors(tmp_path: Path) -> None:
    """A state dict saved with keep_vars=True holds nn.Parameters: read (and written back) as tensors."""
    weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    torch.save({"model": {"w": weight, "view": weight[1]}}, tmp_path / "in.pt")
    model = read_structure(str(tmp_path / "in.pt"))["model"]
    assert type(model["w"]) is TensorRef and model["w"].requires_grad and model["w"].shape == (2, 3)
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    assert type(loaded["w"]) is torch.Tensor and torch.equal(loaded["w"], weight.detach())
    assert torch.equal(loaded["view"], weight[1].detach())


@pytest.mark.parametrize("protocol", [4, 5])
def test_sets_and_bytearrays_of_newer_pickle_protocols_are_written_back(tmp_path: Path, protocol: int) -> None:
    """Protocols 4 and 5 give real set, frozenset and bytearray objects (2 gives calls of their classes)."""
    original = {"kinds": {1, 2}, "frozen": frozenset({"a"}), "buffer": bytearray(b"\x00\xff"), "a": torch.zeros(2)}
    torch.save(original, tmp_path / "in.pt", pickle_protocol=protocol)
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert {k: type(v) for k, v in loaded.items()} == {k: type(v) for k, v in original.items()}
    assert [loaded[k] for k in ("kinds", "frozen", "buffer")] == [original[k] for k in ("kinds", "frozen", "buffer")]


@pytest.mark.parametrize("protocol", [2, 4])
def test_objects_of_nested_classes_are_carried(tmp_path: Path, protocol: int) -> None:
    """Protocol 2 pickles `Outer.Inner` as getattr(Outer, "Inner"), 4 by its dotted name; both are written back as
    protocol 2 does (a dotted name there does not load)."""
    original = {"obj": Outer.Inner(3), "cls": Outer.Inner, "a": torch.zeros(2)}
    torch.save(original, tmp_path / "in.pt", pickle_protocol=protocol)
    obj, unknown = read_checkpoint(str(tmp_path / "in.pt"))
    assert "test_torchzip.Outer.Inner" in unknown and "__builtin__.getattr" not in unknown
    _rewrite(tmp_path / "in.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert loaded["obj"] == original["obj"] and loaded["cls"] is Outer.Inner
    if protocol == 2:
        with zipfile.ZipFile(tmp_path / "in.pt") as archive:
            assert torchzip.pickle_bytes(obj) == archive.read("in/data.pkl")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn])
def test_dtypes_the_reader_lacks_are_named_not_called_corrupt(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.save({"a": torch.zeros(2, dtype=dtype)}, tmp_path / "in.pt")
    with pytest.raises(CheckpointLoadError) as error:
        read_checkpoint(str(tmp_path / "in.pt"))
    assert str(error.value).startswith(f"{tmp_path / 'in.pt'}: holds tensors of torch.") and (
        "which resharding does not support; convert them first" in str(error.value))


def test_unknown_globals_are_never_resolved(tmp_path: Path) -> None:
    """An object whose unpickling would call os.system is kept as a record of that call, never made."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"a": Evil()}, tmp_path / "in.pt")
    obj, unknown = read_checkpoint(str(tmp_path / "in.pt"))
    assert unknown == [f"{os.system.__module__}.system"] and obj["a"].args == (f"touch {marker}",)
    assert not marker.exists()


def test_reshard_cli_runs_without_importing_torch(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.zeros(3)}}, tmp_path / "probe.pt")
    code = (
        "import sys\n"
        "from metaseq import torchzip\n"
        "import metaseq.scripts.reshard_fsdp\n"
        f"torchzip.read_checkpoint({str(tmp_path / 'probe.pt')!r})\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_a_sigterm_during_the_late_torch_import_stops_the_run(tmp_path: Path) -> None:
    """torch's import swallows what a signal handler raises in it, and --output-dtype imports it mid-run: with a
    stand-in that gets a SIGTERM and catches everything, as that import does, the run must still stop."""
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(
        "import importlib, os, signal, sys, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.5)\n"
        "except BaseException:\n"
        "    print('swallowed', flush=True)\n"
        "sys.path.remove(os.path.dirname(os.path.dirname(__file__)))\n"
        "del sys.modules['torch']\n"
        "sys.modules['torch'] = importlib.import_module('torch')  # the real one from here on\n")
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(Path(__file__).parents[1])]))
    proc = subprocess.run([sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input", str(tmp_path / "in/*.pt"),
                           "--output", str(tmp_path / "out" / "s.pt"), "--output-dtype", "fp16", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "swallowed" not in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert "terminated by SIGTERM" in proc.stderr and not (tmp_path / "out").exists()


def test_tensors_saved_on_a_gpu_are_written_as_cpu_tensors(tmp_path: Path) -> None:
    """A GPU run's file names a device per storage; outputs say cpu, as torch.load(map_location="cpu") gives."""
    original = {"w": torch.arange(6, dtype=torch.float32), "step": torch.tensor(3)}
    torch.save(original, tmp_path / "cpu.pt")
    with zipfile.ZipFile(tmp_path / "cpu.pt") as src, zipfile.ZipFile(tmp_path / "gpu.pt", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
                assert data.count(b"cuda:0") == 1  # memoized after its first use
            dst.writestr(info.filename, data)
    _rewrite(tmp_path / "gpu.pt", tmp_path / "out.pt")
    assert b"cuda" not in (tmp_path / "out.pt").read_bytes()
    _assert_same(torch.load(tmp_path / "gpu.pt", map_location="cpu", weights_only=True),
                 torch.load(tmp_path / "out.pt", weights_only=True))


def test_a_pickle_cannot_change_what_other_files_are_read_with(tmp_path: Path) -> None:
    """BUILD sets attributes on what a pickle names; each file gets fresh objects, so only its own."""
    tampered = (b"\x80\x02}q\x00X\x01\x00\x00\x00d"  # {"d": torch.float32 with BUILD {"itemsize": 3}}
                b"ctorch\nfloat32\n}X\x08\x00\x00\x00itemsizeK\x03sbs.")
    with zipfile.ZipFile(tmp_path / "tampered.pt", "w") as archive:
        archive.writestr("archive/data.pkl", tampered)
    assert read_structure(str(tmp_path / "tampered.pt"))["d"].itemsize == 3
    torch.save({"w": torch.zeros(5)}, tmp_path / "clean.pt")
    clean = read_structure(str(tmp_path / "clean.pt"))["w"]
    assert clean.dtype.itemsize == 4 and clean.storage.nbytes == 20
    assert torchzip.dtype_by_name("float32").itemsize == 4


def test_records_that_point_outside_the_file_are_refused(tmp_path: Path) -> None:
    """A central directory claiming more bytes than the file has: torch.load reports it, nothing is copied."""
    torch.save({"a": torch.zeros(1000)}, tmp_path / "in.pt")
    data = bytearray((tmp_path / "in.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "in.pt") as archive:
        info = archive.getinfo("in/data/0")
    entry = data.index(b"PK\x01\x02")  # central directory entries, up to this record's
    while data[entry + 46 : entry + 46 + len(info.filename)] != info.filename.encode():
        entry = data.index(b"PK\x01\x02", entry + 4)
    struct.pack_into("<II", data, entry + 20, 10**8, 10**8)  # its compressed and uncompressed sizes
    (tmp_path / "in.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError, match="past the end"):
        read_structure(str(tmp_path / "in.pt"))


def _local_header_offset(path: Path, name: str) -> int:
    with zipfile.ZipFile(path) as archive:
        return archive.getinfo(name).header_offset


def _duplicate_record(path: Path) -> None:
    torch.save({"a": torch.arange(4.0)}, path)
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        for name, data in records + [(n, bytes(len(d))) for n, d in records if n.endswith("data/0")]:
            archive.writestr(name, data)  # stored, so a reader could take either copy


def _renamed_local_header(path: Path) -> None:
    torch.save({"a": torch.arange(4.0)}, path)
    data = bytearray(path.read_bytes())
    name_at = _local_header_offset(path, f"{path.stem}/data/0") + 30
    data[name_at + len(path.stem) + len("/data/0") - 1] = ord("9")  # data/0 -> data/9 here only
    path.write_bytes(bytes(data))


def _flipped_extra_length(path: Path) -> None:
    torch.save({"a": torch.arange(4.0)}, path)
    data = bytearray(path.read_bytes())
    data[_local_header_offset(path, f"{path.stem}/data/0") + 28] ^= 1  # the tensor's bytes would start 1 off
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("make, words", [(_duplicate_record, "record in/data/0 appears twice"),
                                         (_renamed_local_header, "bad local header of in/data/0"),
                                         (_flipped_extra_length, "bad local header of in/data/0")],
                         ids=["duplicate-record", "renamed-local-header", "flipped-extra-length"])
def test_zip_entries_torch_and_this_reader_could_read_differently_are_refused(tmp_path: Path, make,
                                                                             words: str) -> None:
    make(tmp_path / "in.pt")
    with pytest.raises(CheckpointLoadError, match=words):
        read_structure(str(tmp_path / "in.pt"))
