"""Language codes: the corpus speaks ISO 639-1 (two letters, lower case)."""

from __future__ import annotations

ISO_639_1 = frozenset("""
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de dv dz ee
el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is
it iu ja jv ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms
mt my na nb nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk
sl sm sn so sq sr ss st su sv sw ta te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi
yo za zh zu""".split())

# Names that are not ISO 639-1 but are common in file names and metadata, mapped to their code.
ALIASES = {"iw": "he", "in": "id", "ji": "yi", "jw": "jv"}


def normalize_language(code: str) -> str:
    """'en-US' -> 'en', 'zh_CN' -> 'zh', 'DE' -> 'de'. Raises ValueError for anything not ISO 639-1."""
    if not isinstance(code, str) or not code.strip():
        raise ValueError(f"language code {code!r} is empty; give an ISO 639-1 code such as 'en', 'de' or 'zh'")
    primary = code.strip().replace("_", "-").split("-")[0].lower()
    primary = ALIASES.get(primary, primary)
    if primary not in ISO_639_1:
        raise ValueError(f"unknown language code {code!r}: not ISO 639-1 (two letters such as 'en', 'de', 'zh')")
    return primary
