"""Visual Genome as released: boxes and relations, no masks (relation regions come from the
boxes, `mask_kind="box"`).

    <root>/image_data.json            [{"image_id" (or "id"), "url", "width", "height"}, ...]
    <root>/objects.json               [{"image_id", "objects": [{"object_id", "x", "y", "w",
                                        "h", "names": [...] (or "name")}]}, ...]
    <root>/relationships.json         [{"image_id", "relationships": [{"predicate",
                                        "subject": {object}, "object": {object}}]}, ...]
    <root>/region_descriptions.json   [{"id" (the image id), "regions": [{"phrase", ...}]}]
    <root>/VG_100K/<image_id>.jpg, <root>/VG_100K_2/<image_id>.jpg

Each json may carry its version's suffix instead (objects_v1_4.json, objects_v1_2.json, ...).
Objects are those of objects.json in order, then the subjects and objects of relations that
objects.json does not list (by object_id), with their own boxes; names are the first of
"names", lowercased with whitespace collapsed, as are predicates. Boxes are
(x, y, x + w, y + h) of finite numbers; ids are strings or whole numbers, names, predicates,
phrases and urls strings: an entry with another type is an error naming the file and entry.
The captions are the region descriptions in file order. The photograph is
<root>/<folder>/<file> of its url's last two parts, else VG_100K/ or VG_100K_2/<image_id>.jpg;
an entry whose url or image id names a path outside <root> (`..`, a link out of it) is a skip
(`outside_root`), its photograph never opened.

The split (Visual Genome has none of its own): an image is "test" when the first 8 hex digits
of sha256("vg:<image_id>") read as an integer are below `TEST_FRACTION` * 2^32, else "train"
(`split_of`): deterministic, independent of the order and of the other images.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from data_prep.scene_graphs.graph import Graph, SceneGraphs, ident, numbers, text
from data_prep.source_items import SourceError, id_key, load_json, require_file
from sclaro_jax.paths import OUTSIDE_ROOT, inside_root

TITLE = "Visual Genome"
FILES = ("image_data", "objects", "relationships", "region_descriptions")
LAYOUT = ("<root>/image_data.json, objects.json, relationships.json and "
          "region_descriptions.json (or with a _v1_4 / _v1_2 suffix), images in "
          "<root>/VG_100K/ and <root>/VG_100K_2/")
TEST_FRACTION = 0.2


def split_of(image_id: str) -> str:
    digest = hashlib.sha256(f"vg:{image_id}".encode()).hexdigest()
    return "test" if int(digest[:8], 16) < TEST_FRACTION * 2 ** 32 else "train"


def find_file(root: str, name: str) -> str:
    for suffix in ("", "_v1_4", "_v1_2"):
        path = os.path.join(root, f"{name}{suffix}.json")
        if os.path.isfile(path):
            return path
    return require_file(TITLE, os.path.join(root, f"{name}.json"), LAYOUT)


def _image_key(entry: dict) -> str:
    if "image_id" in entry:
        return ident(entry["image_id"], "image_id")
    return ident(entry["id"], "id")


def _by_image(path: str, field: str) -> dict:
    doc = load_json(TITLE, path)
    try:
        return {_image_key(e): e.get(field) or [] for e in doc}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{TITLE}: {path} is not a list of per-image entries with "
                          f"{field!r}: {e!r}; expected {LAYOUT}") from None


def _name(obj: dict) -> str:
    names = obj.get("names") or [obj.get("name", "")]
    if not isinstance(names, list):
        raise TypeError(f"names is a {type(names).__name__}, not a list")
    return text(names[0], "name").lower()


def _box(obj: dict):
    x, y, w, h = numbers([obj[k] for k in ("x", "y", "w", "h")], 4, "x, y, w, h")
    return numbers((x, y, x + w, y + h), 4, "x, y, x + w, y + h")


def image_path(root: str, image_id: str, url) -> str | None:
    """The photograph's path: the first of <root>/<url's last two parts>, VG_100K/ and
    VG_100K_2/<image_id>.jpg that is a file (else the first); None when any of them resolves
    outside `root` (`outside_root`), before any is looked at."""
    names = [os.path.join(*str(url).split("/")[-2:])] if url else []
    names = [name for name in names if name]  # a url ending in "//" names no file
    names += [os.path.join(d, f"{image_id}.jpg") for d in ("VG_100K", "VG_100K_2")]
    if any(inside_root(root, name) is None for name in names):
        return None
    candidates = [os.path.join(root, name) for name in names]
    return next((p for p in candidates if os.path.isfile(p)), candidates[0])


def graph_of(image_id: str, path: str, objects: list, relationships: list,
             regions: list) -> Graph:
    listed = [(_name(o), _box(o)) for o in objects]
    index = {o.get("object_id", o.get("id")): k for k, o in enumerate(objects)}
    index.pop(None, None)
    relations = []
    for rel in relationships:
        ends = []
        for end in (rel["subject"], rel["object"]):
            key = end.get("object_id", end.get("id"))
            if key is None or key not in index:
                if not all(k in end for k in ("x", "y", "w", "h")):
                    ends.append(-1)  # neither listed nor boxed: counted as out of range
                    continue
                listed.append((_name(end), _box(end)))
                if key is not None:
                    index[key] = len(listed) - 1
            ends.append(index[key] if key is not None else len(listed) - 1)
        relations.append((ends[0], text(rel["predicate"], "predicate").lower(), ends[1]))
    return Graph(id=f"vg/{id_key(image_id)}", split=split_of(image_id), image=path,
                 objects=tuple(listed), relations=tuple(relations),
                 captions=tuple(c for c in (text(r.get("phrase"), "phrase") for r in regions)
                                if c))


def read(root: str, captions: tuple[str, ...] = ()) -> SceneGraphs:
    """Every image of image_data.json as a `Graph`, in the file's order."""
    if captions:
        raise ValueError("--captions is for --source psg; Visual Genome's captions are its "
                         "region descriptions")
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise SourceError(f"{TITLE}: root folder {root} not found; expected {LAYOUT}")
    paths = {name: find_file(root, name) for name in FILES}
    images = load_json(TITLE, paths["image_data"])
    objects = _by_image(paths["objects"], "objects")
    relationships = _by_image(paths["relationships"], "relationships")
    regions = _by_image(paths["region_descriptions"], "regions")
    graphs = []
    for i, entry in enumerate(images if isinstance(images, list) else [None]):
        try:
            image_id, url = _image_key(entry), entry.get("url")
            if url is not None and not isinstance(url, str):
                raise TypeError(f"url is a {type(url).__name__}, not a string")
            path = image_path(root, image_id, url)
            graph = graph_of(image_id, path or "", objects.get(image_id, []),
                             relationships.get(image_id, []), regions.get(image_id, []))
            graphs.append(graph if path else dataclasses.replace(graph, skip=OUTSIDE_ROOT))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            raise SourceError(f"{TITLE}: entry {i} of {paths['image_data']} or its objects / "
                              f"relationships is malformed ({type(e).__name__}: {e}); "
                              f"expected {LAYOUT}") from None
    return SceneGraphs(
        source="vg", mask_kind="box", graphs=graphs,
        split_rule={"method": "sha256", "rule": f"test when int(sha256('vg:<image_id>')[:8], "
                                                  f"16) < {TEST_FRACTION} * 2^32, else train",
                    "test_fraction": TEST_FRACTION},
        files=paths)
