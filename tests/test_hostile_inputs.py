"""The hostile-input corpus (SECURITY.md): files and folders crafted as an attacker, or a careless
colleague, would make them, each run through the real command. Every case ends in one of two
ways: exit 2 with one `error:` line and no traceback, or a counted skip; no payload runs (a
payload only ever writes a marker file); the user's files in a sentinel folder outside every path
a command was given are byte-identical before and after (hashed).

Each crafted file is built here from the published format it imitates (a torch zip, a PSG json,
a FAISS header, a JPEG header), never from this project's own writers alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "PAYLOAD-RAN"  # the file a payload writes where it can; no test may find one


# ------------------------------------------------------------------------------------------------
# The harness every case uses
# ------------------------------------------------------------------------------------------------

def cli(*argv: str, cwd=None, env: dict | None = None, timeout: float = 300,
        stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """`python ARGV...` with the interpreter running the tests and this checkout first on the
    path (so a command that starts from another folder still runs the code under test)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    environ.update(env or {})
    return subprocess.run([sys.executable, *argv], cwd=cwd or ROOT, env=environ, text=True,
                          capture_output=True, timeout=timeout, stdin=stdin)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, exactly one `error:` line (the last one) holding each of `words`, no traceback;
    returns the line."""
    err = proc.stderr
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]


def payload_code(marker: Path) -> str:
    """Python that writes `marker`: the whole of every payload in this corpus."""
    return f"open({str(marker)!r}, 'w').write('ran')\n"


def tree_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes, or '-> target' of a link, or '/' of a folder}."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "/"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Sentinel:
    """A user's folder outside every path a command is given: a few files of their own, hashed
    when made; `check()` asserts nothing in it was written, moved or deleted, and that no
    payload's marker appeared in it or at `marker`."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        (folder / "thesis.tex").write_text("\\section{Results}\n" * 50)
        (folder / "notes").mkdir()
        (folder / "notes" / "todo.txt").write_text("back up the results\n")
        (folder / "weights.bin").write_bytes(os.urandom(4096))
        self.marker = folder.parent / MARKER
        self.hashes = tree_hashes(folder)

    def check(self) -> None:
        assert not self.marker.exists(), "a payload ran"
        assert tree_hashes(self.folder) == self.hashes, "the user's folder changed"


@pytest.fixture
def sentinel(tmp_path) -> Sentinel:
    """A `Sentinel` beside the test's own folders, checked after the test."""
    s = Sentinel(tmp_path / "users_files")
    yield s
    s.check()


def test_the_sentinel_sees_a_write_a_deletion_and_a_marker(tmp_path):
    """The harness can fail: each kind of change to the user's folder is seen."""
    for change in (lambda s: (s.folder / "thesis.tex").write_text("gone"),
                   lambda s: (s.folder / "notes" / "todo.txt").unlink(),
                   lambda s: (s.folder / "new.txt").write_text("x"),
                   lambda s: s.marker.write_text("ran")):
        s = Sentinel(tmp_path / os.urandom(4).hex() / "users_files")
        change(s)
        with pytest.raises(AssertionError):
            s.check()


def test_assert_refused_rejects_a_traceback_and_a_second_error_line():
    def done(rc, err):
        return subprocess.CompletedProcess([], rc, "", err)

    assert assert_refused(done(2, "warning: x\nerror: bad --nprobe\n"), "--nprobe")
    for rc, err in ((1, "error: x\n"), (2, "Traceback (most recent call last):\nerror: x\n"),
                    (2, "error: x\nerror: y\n"), (2, "error: x\nmore\n"), (0, "")):
        with pytest.raises(AssertionError):
            assert_refused(done(rc, err))


# ------------------------------------------------------------------------------------------------
# Why 1-2: nothing deleted that the command did not make; writes never follow links
# ------------------------------------------------------------------------------------------------

# (end of writes and deletions)


# ------------------------------------------------------------------------------------------------
# Why 4: no code from data files (pickles, repository code, configs' folders)
# ------------------------------------------------------------------------------------------------

# (end of code from data)


# ------------------------------------------------------------------------------------------------
# Why 3, 6, 7 (files): bounds before bytes (torch files, FAISS, image headers, JSON, labels,
# control characters)
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------ torch files
# (the helpers of this section write each file byte by byte from the format it imitates)

def _pickle_int(value: int) -> bytes:
    """The pickle opcodes of one int (BININT1 / BININT / LONG1, as protocol 2 writes it)."""
    import pickle
    return pickle.dumps(value, protocol=2)[2:-1]


def _pickle_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data   # BINUNICODE


def torch_state_pickle(key="w", offset=0, size=(4,), stride=(1,), numel=4) -> bytes:
    """data.pkl of `torch.save({key: tensor})` as torch writes it (protocol 2): the tensor
    rebuilt by torch._utils._rebuild_tensor_v2 from a persistent-id FloatStorage, only the
    globals a state dict uses."""
    ints = lambda values: b"(" + b"".join(map(_pickle_int, values)) + b"t"  # noqa: E731
    return (b"\x80\x02}" + _pickle_str(key) + b"ctorch._utils\n_rebuild_tensor_v2\n("
            + b"(" + _pickle_str("storage") + b"ctorch\nFloatStorage\n" + _pickle_str("0")
            + _pickle_str("cpu") + _pickle_int(numel) + b"tQ"        # BINPERSID
            + _pickle_int(offset) + ints(size) + ints(stride)
            + b"\x89ccollections\nOrderedDict\n)Rt" + b"Rs.")      # False, hooks; SETITEM


def torch_zip(path: Path, nbytes: int = 16, **tensor) -> Path:
    """A `torch.save` zip archive (the members and order torch 2.x writes) of one float32
    tensor over a storage record of `nbytes` bytes."""
    import zipfile
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", torch_state_pickle(**tensor))
        z.writestr("archive/.format_version", "1")
        z.writestr("archive/.storage_alignment", "64")
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(range(nbytes)))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/.data/serialization_id", "0" * 40)
    return path


# a script that reads a torch file the way every command does, and reports as a command does
READ_TORCH_FILE = """
import sys
from sclaro_jax import cli
from sclaro_jax.models.torch_files import read_state_dict
try:
    state = read_state_dict(sys.argv[1])
except cli.USER_ERRORS as e:
    sys.exit(cli.fail(e))
print({k: v.shape for k, v in state.items()})
"""

# tensor layouts reaching past a 4-element storage (or declaring another element count)
PAST_THE_STORAGE = {
    "size": dict(size=(1 << 28,)), "stride": dict(stride=(1 << 26,)),
    "offset": dict(offset=1 << 26), "negative_offset": dict(offset=-4),
    "element_count": dict(numel=1 << 26), "strides_for_sizes": dict(stride=(1, 1)),
}


def test_the_crafted_torch_file_has_torch_saves_layout(tmp_path):
    """The builder imitates the format: the members torch.save writes, a file torch and our
    reader both load to the same numbers."""
    import zipfile

    import numpy as np
    import torch

    torch.save({"w": torch.zeros(4)}, tmp_path / "real.pt")
    real = sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(tmp_path / "real.pt").namelist())
    made = torch_zip(tmp_path / "made.pt")
    assert sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(made).namelist()) == real
    want = torch.load(made, weights_only=True)["w"].numpy()
    proc = cli("-c", READ_TORCH_FILE + "print(state['w'].tobytes().hex())", str(made))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == want.tobytes().hex() == np.arange(16, dtype=np.uint8
                                                                         ).tobytes().hex()


@pytest.mark.parametrize("layout", sorted(PAST_THE_STORAGE))
def test_a_torch_tensor_past_its_storage_is_refused_before_any_view(layout, tmp_path,
                                                                    sentinel):
    """Offsets, sizes and strides that reach past the storage (or an element count its record
    does not hold) are refused naming the file and the key; torch refuses each too."""
    import torch

    path = torch_zip(tmp_path / "weights.pt", **PAST_THE_STORAGE[layout])
    assert path.stat().st_size < 1100
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)   # the independent check
    assert_refused(cli("-c", READ_TORCH_FILE, str(path)), str(path), "tensor w")


def test_a_torch_file_past_its_storage_through_the_launcher_is_one_line(tmp_path, demo_dir,
                                                                        sentinel):
    """`--config.model.init=FILE:gelu` with a tensor 2^28 elements long over 4: exit 2, not a
    segmentation fault (-11) or a model built from process memory."""
    path = torch_zip(tmp_path / "clip.bin", size=(1 << 28,))
    proc = cli("launch/train.py", "--config", "configs/pyramidclip.py:demo", "--workdir",
               str(tmp_path / "run"), f"--config.data.dir={demo_dir}",
               f"--config.model.init={path}:gelu", "--config.train.steps=1",
               "--config.progress_bar=False")
    assert proc.returncode != -11
    assert_refused(proc, str(path), "tensor w", "past the 4 elements")


# ------------------------------------------------------------------------ FAISS index files

PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.run([sys.executable, *sys.argv[1:]]).returncode
print("peak_rss_kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""


def _peak_mb(proc) -> float:
    return int(proc.stdout.split("peak_rss_kb")[-1]) / 1024


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    """A real index of 50 images built by `index build` (global.faiss: a flat inner-product
    index, 3.4 KB), its queries."""
    import numpy as np

    folder = tmp_path_factory.mktemp("index")
    rng = np.random.default_rng(0)
    images = rng.normal(size=(50, 16)).astype(np.float32)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    np.save(folder / "images.npy", images)
    np.save(folder / "bank.npy", images[:20])
    np.save(folder / "queries.npy", images[:5])
    proc = cli("-m", "sclaro_jax.miner.index", "build", "--images", str(folder / "images.npy"),
               "--bank", str(folder / "bank.npy"), "--out", str(folder / "idx"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder


@pytest.mark.parametrize("declared", [2 << 30, 512 << 30], ids=["2GiB", "512GiB"])
def test_a_faiss_header_declaring_a_huge_vector_is_refused_before_it_allocates(
        declared, tiny_index, tmp_path, sentinel):
    """global.faiss with its codes vector's length patched (same file size, so the size the
    build recorded still matches): refused in one line naming the file, the search's peak
    memory that of a search (faiss's own limit, 1 TiB, would allocate 2 GiB first)."""
    import shutil
    import struct

    idx = tmp_path / "idx"
    shutil.copytree(tiny_index / "idx", idx)
    data = bytearray((idx / "global.faiss").read_bytes())
    # IndexFlatIP ("IxFI"): d int32, ntotal int64, two int64, is_trained uint8, metric int32,
    # then the codes: a uint64 count of floats and the floats
    assert data[:4] == b"IxFI"
    d, ntotal = struct.unpack_from("<iq", data, 4)
    assert struct.unpack_from("<Q", data, 37)[0] == d * ntotal
    struct.pack_into("<Q", data, 37, declared // 4)
    (idx / "global.faiss").write_bytes(bytes(data))
    proc = cli("-c", PEAK_RSS, "-m", "sclaro_jax.miner.index", "search", "--index", str(idx),
               "--queries", str(tiny_index / "queries.npy"), "--out", str(tmp_path / "hits"),
               "--no-progress")
    assert_refused(proc, str(idx / "global.faiss"))
    assert _peak_mb(proc) < 1024, _peak_mb(proc)
    assert not (tmp_path / "hits" / "hits.npz").exists()


# ------------------------------------------------------------------------ image headers

def jpeg_of_size(width: int, height: int) -> bytes:
    """A real 64 x 64 JPEG whose SOF header (ITU T.81 B.2.2: length, precision, Y, X) says
    `width` x `height`: the scan is the small image's."""
    import io
    import struct

    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()[::8, ::8]).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):   # SOF0 / SOF1 / SOF2
        i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    struct.pack_into(">HH", data, i + 5, height, width)
    return bytes(data)


def png_of_size(pixels, width: int, height: int) -> bytes:
    """A real PNG of `pixels` whose IHDR (PNG spec 11.2.2) says `width` x `height`, its CRC
    recomputed so a reader takes the header as valid."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    assert data[12:16] == b"IHDR"
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_a_record_jpeg_past_the_pixel_limit_is_refused_before_the_decoder_allocates(
        sentinel):
    """The input pipeline's decoder (simplejpeg, which skips Pillow's limit) on a JPEG whose
    header says 60000 x 60000 (10 GiB of pixels): a RecordError naming it (a counted bad
    record in the pipeline), under a 2 GiB address-space limit that a 10 GiB buffer breaks."""
    pytest.importorskip("simplejpeg")
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from sclaro_jax.data import decode, schema\n"
            "try:\n"
            "    decode.decode_array(sys.stdin.buffer.read(), \"sample 'x': train_image\",\n"
            "                        backend='simplejpeg')\n"
            "except schema.RecordError as e:\n"
            "    print(f'error: {e}', file=sys.stderr)\n"
            "    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", code], input=jpeg_of_size(60000, 60000),
                          capture_output=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                       proc.stderr.decode())
    assert_refused(proc, "sample 'x': train_image", "60000x60000", "pixel limit")


def _coco_gallery(folder: Path, name: str = "gallery.json", bomb: bool = False) -> Path:
    """A COCO captions gallery of three real photographs (the second, with `bomb`, a JPEG
    whose header says 60000 x 60000)."""
    import json

    import skimage.data
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, photo in enumerate(("astronaut", "coffee", "chelsea")):
        pixels = getattr(skimage.data, photo)()[::8, ::8]
        if bomb and i == 1:
            (folder / f"im{i}.jpg").write_bytes(jpeg_of_size(60000, 60000))
        else:
            Image.fromarray(pixels).save(folder / f"im{i}.jpg")
    (folder / name).write_text(json.dumps({
        "images": [{"id": i, "file_name": f"im{i}.jpg"} for i in range(3)],
        "annotations": [{"image_id": i, "caption": f"photo number {i}"} for i in range(3)]}))
    return folder / name


def test_an_image_bomb_in_a_rocs_gallery_is_one_error_line(tmp_path, sentinel):
    split = _coco_gallery(tmp_path / "gallery", bomb=True)
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               str(split), "--out", str(tmp_path / "out"), "--no-progress")
    assert_refused(proc, "im1.jpg", "3600000000 pixels")
    assert not (tmp_path / "out" / "results.md").exists()


def test_control_characters_in_a_gallery_name_are_escaped_in_results_md_and_the_terminal(
        tmp_path, sentinel):
    """A split file named with ESC [31m (red), BEL and U+202E: the table in results.md and on
    the terminal shows them escaped."""
    split = _coco_gallery(tmp_path / "gallery", name="g\x1b[31mal\x07\u202elery.json")
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               str(split), "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "out" / "results.md").read_text()
    assert "g\\x1b[31mal\\x07\\u202elery R@1" in table and "g\\x1b" in proc.stdout
    for text in (table, proc.stdout, proc.stderr):
        assert not any(c in text for c in "\x1b\x07\u202e"), text[-500:]


# ------------------------------------------------------------------------ scene-graph imports

PSG_PHOTOS = ("astronaut", "coffee", "chelsea")


def psg_root(root: Path, things=("person", "cat"), predicates=("on", "beside"),
             images=None, captions=None) -> Path:
    """An OpenPSG release in miniature, as `python -m data_prep import --source psg` reads
    it: psg/psg.json, coco/ photographs and panoptic PNGs (segment ids RGB-encoded), COCO
    captions. `images`: per image (thing category, predicate index, panoptic PNG bytes or
    None for a real one); each image is a thing on the left, a wall (stuff) on the right."""
    import io
    import json

    import numpy as np
    import skimage.data
    from PIL import Image

    images = images or [(0, 0, None), (0, 0, None)]
    coco = root / "coco"
    for sub in ("train2017", "panoptic_train2017", "annotations"):
        (coco / sub).mkdir(parents=True, exist_ok=True)
    (root / "psg").mkdir(parents=True, exist_ok=True)
    data = []
    for k, (thing, predicate, panoptic) in enumerate(images):
        pixels = np.asarray(Image.fromarray(getattr(skimage.data, PSG_PHOTOS[k % 3])())
                            .convert("RGB").resize((64, 48)))
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
        (coco / f"train2017/{k + 1:012d}.jpg").write_bytes(buf.getvalue())
        ids = np.zeros((48, 64, 3), np.uint8)
        ids[:, :32, 0], ids[:, 32:, 0] = 1, 2   # segment ids 1 and 2 (R + 256 G + 256^2 B)
        png = coco / f"panoptic_train2017/{k + 1:012d}.png"
        if panoptic is None:
            Image.fromarray(ids).save(png)
        else:
            png.write_bytes(panoptic)
        data.append({"file_name": f"train2017/{k + 1:012d}.jpg", "image_id": str(k + 1),
                     "width": 64, "height": 48,
                     "pan_seg_file_name": f"panoptic_train2017/{k + 1:012d}.png",
                     "segments_info": [{"id": 1, "category_id": thing, "iscrowd": 0},
                                       {"id": 2, "category_id": len(things), "iscrowd": 0}],
                     "annotations": [{"bbox": [0, 0, 32, 48], "category_id": thing},
                                     {"bbox": [32, 0, 64, 48], "category_id": len(things)}],
                     "relations": [[0, 1, predicate]]})
    (root / "psg" / "psg.json").write_text(json.dumps(
        {"data": data, "thing_classes": list(things), "stuff_classes": ["wall"],
         "predicate_classes": list(predicates), "test_image_ids": []}))
    captions = captions or ["A person stands by a wall."] * len(images)
    (coco / "annotations" / "captions_train2017.json").write_text(json.dumps(
        {"images": [{"id": k + 1, "file_name": f"{k + 1:012d}.jpg"} for k in range(len(images))],
         "annotations": [{"id": k + 1, "image_id": k + 1, "caption": c}
                         for k, c in enumerate(captions)]}))
    return root


def import_psg(root: Path, out: Path, *flags: str, env=None) -> subprocess.CompletedProcess:
    return cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(out), "--no-actions", "--workers", "1", "--image-size", "32",
               "--no-progress", *flags, env=env)


def _summary(out: Path) -> dict:
    import json
    return json.loads((out / "manifest.json").read_text())["import"]


def test_a_panoptic_png_bomb_is_a_counted_skip_in_a_psg_import(tmp_path, sentinel):
    """A real PNG with its IHDR saying 60000 x 60000 (CRC fixed): the image is skipped and
    counted (bad_panoptic_png), as the import's docstring promises; the other is imported."""
    import numpy as np

    bomb = png_of_size(np.zeros((48, 64, 3), np.uint8), 60000, 60000)
    root = psg_root(tmp_path / "psg", images=[(0, 0, None), (0, 0, bomb)])
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_traceback(proc)
    summary = _summary(tmp_path / "out")
    assert summary["kept"] == 1 and summary["skipped"] == {"bad_panoptic_png": 1}
    assert "bad_panoptic_png 1" in proc.stdout


def test_long_class_names_are_skipped_and_counted_not_written_to_objects_txt(tmp_path,
                                                                              sentinel):
    """A 2 MB class name (of the 200 MB kind) at the default limit, and a 40-character one
    under SCLARO_MAX_LABEL_CHARS=16: each object dropped and counted (long_label), its relation
    with it; objects.txt holds the names within the limit only."""
    long_name = "giant " * 350_000
    root = psg_root(tmp_path / "psg", things=("person", long_name),
                    images=[(0, 0, None), (1, 0, None), (0, 1, None)])
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "out")
    assert summary["objects_dropped"] == {"long_label": 1}
    assert summary["skipped"] == {"no_relations": 1} and summary["kept"] == 2
    objects = (tmp_path / "out" / "objects.txt").read_text().splitlines()
    assert objects == ["person", "wall"]
    assert "long_label 1" in proc.stdout

    root = psg_root(tmp_path / "psg2", things=("person", "a cat with a very long tail indeed"),
                    images=[(0, 0, None), (1, 0, None)])
    proc = import_psg(root, tmp_path / "out2", env={"SCLARO_MAX_LABEL_CHARS": "16"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _summary(tmp_path / "out2")["objects_dropped"] == {"long_label": 1}
    assert (tmp_path / "out2" / "objects.txt").read_text().splitlines() == ["person", "wall"]


def test_control_characters_in_psg_labels_are_skipped_and_counted_and_never_printed(
        tmp_path, sentinel):
    """A class name with ESC [2J (clear the screen), a predicate with U+202E, a caption with
    BEL: the object and the relation are dropped and counted (control_characters), never in
    objects.txt / relations.txt / predicates.txt, and the terminal sees no control character."""
    root = psg_root(tmp_path / "psg", things=("person", "ca\x1b[2Jt"),
                    predicates=("on", "ne\u202ear"),
                    images=[(0, 0, None), (1, 0, None), (0, 1, None)],
                    captions=["A person by a wall.\x07"] * 3)
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "out")
    assert summary["objects_dropped"] == {"control_characters": 1}
    assert summary["relations_dropped"] == {"control_characters": 1, "object_dropped": 1}
    for name in ("objects.txt", "relations.txt", "predicates.txt", "actions.txt"):
        text = (tmp_path / "out" / name).read_text()
        assert not any(c in text for c in "\x1b\u202e\x07"), (name, text)
    for text in (proc.stdout, proc.stderr):
        assert not any(c in text for c in "\x1b\u202e\x07"), text


def test_control_characters_in_a_file_name_are_escaped_in_the_error_line(tmp_path, sentinel):
    root = psg_root(tmp_path / "psg")
    captions = tmp_path / "captions\x1b]0;owned\x07\x1b[2J.json"   # not there
    proc = import_psg(root, tmp_path / "out", "--captions", str(captions))
    line = assert_refused(proc, "captions\\x1b]0;owned\\x07\\x1b[2J.json")
    assert not any(c in proc.stderr for c in "\x1b\x07"), line


def test_a_vocabulary_file_holding_control_characters_is_refused_when_read(tmp_path,
                                                                           demo_dir, sentinel):
    """actions.txt with ESC [2J and U+202E added to a label (what the wds export copies into
    classnames.txt): refused naming the file and line."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(demo_dir, data)
    lines = (data / "actions.txt").read_text().splitlines()
    lines[0] += "\x1b[2J\u202e"
    (data / "actions.txt").write_text("\n".join(lines) + "\n")
    proc = cli("-m", "sclaro_jax.export.wds", "--data", str(data), "--split", "test", "--out",
               str(tmp_path / "wds"))
    assert_refused(proc, "actions.txt line 1", "\\x1b[2J\\u202e")
    assert not (tmp_path / "wds" / "classnames.txt").exists()


@pytest.mark.parametrize("how", ["over_the_size_limit", "nested_too_deep"])
def test_a_psg_json_over_the_size_limit_or_nested_too_deep_is_one_error_line(how, tmp_path,
                                                                            sentinel):
    root = psg_root(tmp_path / "psg")
    env = None
    if how == "over_the_size_limit":
        env = {"SCLARO_MAX_JSON_BYTES": "500"}   # psg.json is about 1.5 KB here
        words = ("psg.json", "over the 500 byte limit", "SCLARO_MAX_JSON_BYTES")
    else:
        (root / "psg" / "psg.json").write_text('{"data": ' + "[" * 100_000 + "]" * 100_000
                                               + "}")
        words = ("psg.json", "nested too deep")
    assert_refused(import_psg(root, tmp_path / "out", env=env), *words)
    assert not (tmp_path / "out" / "manifest.json").exists()


# ------------------------------------------------------------------------ model files, metadata

def test_a_groundingdino_bin_with_a_payload_is_one_error_line_never_unpickled(tmp_path,
                                                                              sentinel):
    """A detector folder whose weights are a pickled pytorch_model.bin carrying a payload:
    `rocs --detector` refuses it in one line (safetensors only), the payload never runs."""
    import numpy as np
    import torch
    from PIL import Image

    from data_prep.detect import save_tiny_model

    folder = Path(save_tiny_model(str(tmp_path / "gdino")))
    (folder / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (exec, (payload_code(sentinel.marker),))

    torch.save({"model": Payload()}, folder / "pytorch_model.bin")
    (tmp_path / "images").mkdir()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(tmp_path / "images" / "a.jpg")
    (tmp_path / "sam.pth").write_bytes(b"")
    (tmp_path / "replies.json").write_text("{}")
    proc = cli("-m", "data_prep", "rocs", "--images", str(tmp_path / "images"), "--detector",
               str(folder), "--classes", "cat", "--sam", str(tmp_path / "sam.pth"),
               "--vlm-replies", str(tmp_path / "replies.json"), "--out",
               str(tmp_path / "out"), "--device", "cpu", "--no-progress")
    assert_refused(proc, str(folder), "safetensors")


def test_checkpoint_metadata_nested_deep_is_one_error_line(tmp_path, sentinel):
    """A run whose checkpoint's _CHECKPOINT_METADATA nests 10^5 objects deep: the run check
    names the file (a damaged checkpoint), not a RecursionError."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "1").mkdir(parents=True)
    (workdir / "config.json").write_text("{}")
    (workdir / "checkpoints" / "1" / "_CHECKPOINT_METADATA").write_text('{"a": ' * 100_000)
    proc = cli("-m", "sclaro_jax.train.export", "--workdir", str(workdir), "--level", "global",
               "--out", str(tmp_path / "out"))
    assert_refused(proc, "_CHECKPOINT_METADATA", "nested too deep")


def test_a_vlm_reply_nested_too_deep_is_a_parse_error():
    from data_prep.vlm_reply import ParseError, parse_response

    with pytest.raises(ParseError, match="too_deep"):
        parse_response('{"objects": ' + "[" * 100_000 + '"dog"' + "]" * 100_000 + "}")


# (end of bounds)


# ------------------------------------------------------------------------------------------------
# Why 5, 8: paths from data stay inside their root; services on loopback only
# ------------------------------------------------------------------------------------------------

# (end of paths and services)


# ------------------------------------------------------------------------------------------------
# Why 7 (commands): the index commands' numbers and interrupts, missing extras
# ------------------------------------------------------------------------------------------------

# (end of index commands)
