"""NLTK and its data, which a few rules need (curate's POS tagger and WordNet lemmatiser, the
action word `import` takes from captions): `MissingNLTKData`, and `require_nltk`, which checks
that a resource is installed before any work starts, so a missing download is one clear error
naming what to install, never a silent fallback.
"""

from __future__ import annotations

TAGGER_RESOURCE = "taggers/averaged_perceptron_tagger_eng/"  # what nltk 3.9+ pos_tag loads
TAGGER_INSTALL = "python -m nltk.downloader averaged_perceptron_tagger_eng"
WORDNET_RESOURCE = "corpora/wordnet"
WORDNET_INSTALL = "python -m nltk.downloader wordnet"


class MissingNLTKData(RuntimeError):
    """NLTK, or the data one of its rules needs (POS tagger, WordNet), is not installed."""


def require_nltk(purpose: str, resources: dict[str, str] | None = None,
                 alternative: str = ""):
    """The `nltk` module, after checking that every resource of `resources` ({`nltk.data.find`
    path such as "corpora/wordnet": the command that installs it}) is installed; else one
    `MissingNLTKData` naming all that are missing: `purpose` ("... , which") needs nltk / them,
    `alternative` (", or ...") is a way around it."""
    resources = resources or {}
    try:
        import nltk
    except ImportError as e:
        then = "".join(f", then {cmd}" for cmd in resources.values())
        raise MissingNLTKData(f"{purpose} needs nltk, which is not installed: pip install nltk"
                              f"{then}{alternative}") from e
    missing = {}
    for resource, install in resources.items():
        try:
            nltk.data.find(resource)
        except LookupError:
            missing[resource] = install
    if missing:
        names = " and ".join(map(repr, missing))
        raise MissingNLTKData(
            f"{purpose} (nltk {nltk.__version__}) needs the resource{'s' * (len(missing) > 1)} "
            f"{names}; not in any NLTK data folder ({', '.join(map(str, nltk.data.path))}). "
            f"Install {'them' if len(missing) > 1 else 'it'} with:\n"
            + "".join(f"    {cmd}\n" for cmd in missing.values())
            + f"or point the NLTK_DATA environment variable at a folder that holds "
              f"{'them' if len(missing) > 1 else 'it'}{alternative}") from None
    return nltk
