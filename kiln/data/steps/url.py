"""URL blocklist filter (`url_filter`): drop pages by the domain, words and substrings of `meta.url`.

The rule is the one datatrove's URLFilter applies for FineWeb (there with the UT1 blocklist of
adult and spam sites): a page is dropped when its host, or any domain above it, is listed
(`blocked_domain`; `example.com` blocks `www.example.com` and `a.b.example.com`, not
`notexample.com`), when one of the words of its URL is listed (`blocked_url_word`; words are the
URL's runs of letters and digits, so `sex` blocks `/sex/` and `sex-toys` but not `/essex/`), or
when a listed substring occurs anywhere in the lowercased URL (`blocked_url_substring`, for
words that hide inside others). Lists come from the recipe or from files, one entry per line,
`#` comments. Documents without a URL pass (counter `no_url`) unless `require_url` drops them
(`missing_url`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kiln.data.steps.base import Filter, register
from kiln.errors import ConfigError

URL_WORD = re.compile(r"[^\W_]+")


def read_list(path: str, key: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"{path}: cannot read the list ({type(err).__name__})") from None
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def url_host(url: str) -> str:
    try:
        host = urlsplit(url if "//" in url else "//" + url).hostname or ""
    except ValueError:  # an unbalanced [ in a netloc
        return ""
    return host.lower().rstrip(".").removeprefix("www.")


@register
@dataclass
class UrlFilter(Filter):
    name = "url_filter"
    block_domains: list[str] = field(default_factory=list)  # a domain blocks itself and its subdomains
    block_words: list[str] = field(default_factory=list)  # whole words of the URL
    block_substrings: list[str] = field(default_factory=list)  # anywhere in the lowercased URL
    domain_files: list[str] = field(default_factory=list)  # one domain per line
    word_files: list[str] = field(default_factory=list)
    substring_files: list[str] = field(default_factory=list)
    require_url: bool = False  # drop documents without meta.url ("missing_url")

    def validate(self) -> None:
        self.setup()  # unreadable list files fail at recipe load, not in a worker

    def setup(self) -> None:
        self._domains = {url_host(d) for d in self.block_domains}
        self._domains |= {url_host(d) for path in self.domain_files for d in read_list(path, "domain_files")}
        self._domains.discard("")
        self._words = {w.lower() for w in self.block_words}
        self._words |= {w.lower() for path in self.word_files for w in read_list(path, "word_files")}
        self._substrings = [s.lower() for s in self.block_substrings]
        self._substrings += [s.lower() for path in self.substring_files for s in read_list(path, "substring_files")]
        if any(not s for s in self._substrings):
            raise ConfigError("block_substrings", "an empty substring would block every URL")

    def reason(self, doc: dict) -> str | None:
        url = doc["meta"].get("url")
        if not isinstance(url, str) or not url:
            if self.require_url:
                return "missing_url"
            self.stats.count("no_url")
            return None
        host = url_host(url)
        parts = host.split(".")
        if any(".".join(parts[i:]) in self._domains for i in range(len(parts))):
            return "blocked_domain"
        lowered = url.lower()
        if self._words and any(word in self._words for word in URL_WORD.findall(lowered)):
            return "blocked_url_word"
        if any(s in lowered for s in self._substrings):
            return "blocked_url_substring"
        return None
