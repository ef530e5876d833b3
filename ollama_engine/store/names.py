"""Model names as Ollama parses and validates them (types/model/name.go).

`[scheme://][host/][namespace/]model[:tag]`, defaults registry.ollama.ai / library / latest. Every part
starts with a letter, digit or `_`; `.` is not allowed in a namespace and `:` only in the host; so no
part can be `..` or contain a slash, and a valid name always maps to a path inside the manifests folder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_SCHEME = "https"
MISSING_PART = "!MISSING!"  # a part promised by a separator but empty: never valid

_PART_KINDS = ("host", "namespace", "model", "tag")


@dataclass(frozen=True)
class Name:
    host: str = ""
    namespace: str = ""
    model: str = ""
    tag: str = ""
    scheme: str = ""

    def is_valid(self) -> bool:
        """All four parts present and valid (Ollama's IsFullyQualified)."""
        return all(is_valid_part(kind, getattr(self, kind)) for kind in _PART_KINDS)

    def parts(self) -> tuple[str, str, str, str]:
        """host, namespace, model, tag: the manifest's path below `manifests/`. Only for valid names."""
        if not self.is_valid():
            raise ValueError(f"invalid model name {str(self)!r}")
        return self.host, self.namespace, self.model, self.tag

    def __str__(self) -> str:
        out = ""
        if self.host:
            out += self.host + "/"
        if self.namespace:
            out += self.namespace + "/"
        out += self.model
        if self.tag:
            out += ":" + self.tag
        return out

    def display_shortest(self) -> str:
        """`model:tag`, `ns/model:tag`, or `host/ns/model:tag`: the name shown in lists and responses."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    def equal_fold(self, other: Name) -> bool:
        return all(getattr(self, k).lower() == getattr(other, k).lower() for k in _PART_KINDS)


def parse_name_bare(s: str) -> Name:
    """Split a name into its parts without defaults (Ollama's ParseNameBare)."""
    tag = ""
    if s.rfind(":") > s.rfind("/"):  # "/" cannot be in a tag, so a later ":" starts the tag
        s, tag, _ = _cut_promised(s, ":")
    s, model, promised = _cut_promised(s, "/")
    if not promised:
        return Name(model=s, tag=tag)
    s, namespace, promised = _cut_promised(s, "/")
    if not promised:
        return Name(namespace=s, model=model, tag=tag)
    scheme, sep, host = s.partition("://")
    if not sep:
        scheme, host = "", scheme
    return Name(host=host, namespace=namespace, model=model, tag=tag, scheme=scheme)


def parse_name(s: str) -> Name:
    """A name with Ollama's defaults filled in for missing host, namespace and tag (Ollama's ParseName)."""
    n = parse_name_bare(s)
    return replace(n, host=n.host or DEFAULT_HOST, namespace=n.namespace or DEFAULT_NAMESPACE,
                   tag=n.tag or DEFAULT_TAG, scheme=n.scheme or DEFAULT_SCHEME)


def name_from_parts(parts: tuple[str, ...] | list[str]) -> Name | None:
    """A name from a manifest's four path parts below `manifests/`; None unless valid."""
    if len(parts) != 4:
        return None
    n = Name(*parts)
    return n if n.is_valid() else None


def is_valid_part(kind: str, s: str) -> bool:
    """One part's length and characters (Ollama's isValidPart)."""
    limit = 350 if kind == "host" else 80
    if not 1 <= len(s) <= limit or not _alnum_or_underscore(s[0]):
        return False
    for ch in s[1:]:
        if ch in "_-":
            continue
        if ch == ".":
            if kind == "namespace":
                return False
        elif ch == ":":
            if kind not in ("host", "digest"):
                return False
        elif not _alnum_or_underscore(ch):
            return False
    return True


def is_valid_namespace(s: str) -> bool:
    return is_valid_part("namespace", s)


def _alnum_or_underscore(ch: str) -> bool:
    return ch == "_" or ("a" <= ch <= "z") or ("A" <= ch <= "Z") or ("0" <= ch <= "9")


def _cut_promised(s: str, sep: str) -> tuple[str, str, bool]:
    i = s.rfind(sep)
    if i < 0:
        return s, "", False
    return s[:i] or MISSING_PART, s[i + len(sep):] or MISSING_PART, True
