"""Scrub personal data: emails, phone numbers, IP addresses, card numbers, IBANs, national ids.

Each kind is a regular expression that finds candidates plus a check that real data passes and
look-alikes fail: Luhn for card numbers, ISO 13616 mod-97 and the country's length for IBANs, the
ISO 7064 check character and a real birth date for Chinese resident ids, the SSA's never-issued
ranges for US SSNs, the numbering plans for phones, `ipaddress` for IPs. Matches become typed
tokens (`<EMAIL>`, `<PHONE>`, `<IP>`, `<CREDIT_CARD>`, `<IBAN>`, `<ID>`).

Kinds are scrubbed one after another in PII_TYPES order, so text already replaced by a stricter
check (an IBAN, an id with a checksum) cannot be claimed by a looser one (a phone number).

Boundaries are ASCII-only (`[A-Za-z0-9_]`, not `\\w`): Chinese text writes numbers directly after
characters ("电话13800138000"), and `\\w` counts those characters as word characters.

By default only globally routable IP addresses are scrubbed, as datatrove does: private, loopback
and documentation addresses (192.168.0.1, 127.0.0.1, 2001:db8::1) identify no one and fill the
technical text we want to keep verbatim.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections import Counter
from dataclasses import dataclass, field

from kiln.data.steps.base import Filter, register
from kiln.errors import ConfigError

PII_TYPES = ("email", "ip", "iban", "id", "credit_card", "phone")
PII_TOKENS = {
    "email": "<EMAIL>",
    "ip": "<IP>",
    "iban": "<IBAN>",
    "id": "<ID>",
    "credit_card": "<CREDIT_CARD>",
    "phone": "<PHONE>",
}

# Not preceded by an ASCII word character, a sign or a number's punctuation: "v1.2.3.4", "x-415..."
# and the digits inside a longer number must not start a match.
START = r"(?<![A-Za-z0-9_+\-.])"
END = r"(?![A-Za-z0-9_\-]|\.\d)"

EMAIL_RE = re.compile(
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]+@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,63}(?![A-Za-z0-9\-])"
)

IPV4_RE = re.compile(START + r"(?:\d{1,3}\.){3}\d{1,3}" + END)
# Candidates only: hex groups and colons (at least two colons), maybe an IPv4 tail; `ipaddress`
# decides. Times (12:30:45) and MAC addresses (6 groups, no "::") fail that check.
IPV6_RE = re.compile(
    r"(?<![A-Za-z0-9_:.])(?=[0-9A-Fa-f:]*:[0-9A-Fa-f]*:)[0-9A-Fa-f:]{2,39}"
    r"(?:(?<=:)\d{1,3}(?:\.\d{1,3}){3})?(?![A-Za-z0-9_:]|\.\d)"
)

IBAN_RE = re.compile(r"(?<![A-Za-z0-9_])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){10,30}(?![A-Za-z0-9_])")
# IBAN lengths by country, from the SWIFT IBAN registry.
IBAN_LENGTHS = {
    "AD": 24,
    "AE": 23,
    "AL": 28,
    "AT": 20,
    "AZ": 28,
    "BA": 20,
    "BE": 16,
    "BG": 22,
    "BH": 22,
    "BR": 29,
    "BY": 28,
    "CH": 21,
    "CR": 22,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "DO": 28,
    "EE": 20,
    "EG": 29,
    "ES": 24,
    "FI": 18,
    "FO": 18,
    "FR": 27,
    "GB": 22,
    "GE": 22,
    "GI": 23,
    "GL": 18,
    "GR": 27,
    "GT": 28,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IL": 23,
    "IQ": 23,
    "IS": 26,
    "IT": 27,
    "JO": 30,
    "KW": 30,
    "KZ": 20,
    "LB": 28,
    "LC": 32,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MD": 24,
    "ME": 22,
    "MK": 19,
    "MR": 27,
    "MT": 31,
    "MU": 30,
    "NL": 18,
    "NO": 15,
    "PK": 24,
    "PL": 28,
    "PS": 29,
    "PT": 25,
    "QA": 29,
    "RO": 24,
    "RS": 22,
    "SA": 24,
    "SC": 31,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "ST": 25,
    "SV": 28,
    "TL": 23,
    "TN": 24,
    "TR": 26,
    "UA": 29,
    "VA": 22,
    "VG": 24,
    "XK": 20,
}

# Chinese resident identity card (GB 11643): 6-digit region (first digit 1-8), birth date
# YYYYMMDD, 3-digit sequence, check character.
CN_ID_RE = re.compile(
    r"(?<![A-Za-z0-9_])[1-8]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])"
    r"\d{3}[\dXx](?![A-Za-z0-9_])"
)
CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
CN_ID_CHECK = "10X98765432"  # ISO 7064 MOD 11-2 check character for sum % 11 = 0..10
# US SSN, written with dashes or spaces (a bare 9-digit number is too often something else).
SSN_RE = re.compile(START + r"(\d{3})([- ])(\d{2})\2(\d{4})" + END)
# UK National Insurance number; the letters D, F, I, Q, U, V never appear in the prefix, O never second.
NINO_RE = re.compile(
    r"(?<![A-Za-z0-9_])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?\d{2} ?\d{2} ?\d{2} ?[A-D]"
    r"(?![A-Za-z0-9_])"
)
NINO_BAD_PREFIXES = {"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"}

# 13-19 digits, optionally grouped by spaces or dashes (one kind of separator).
CARD_RE = re.compile(START + r"\d(?:[ \-]?\d){12,18}" + END)

# International: "+" country code (never starting with 0), then groups split by one separator each (required, so a digit
# run has only one parse and the regex cannot backtrack explosively), or a compact "+4915112345678".
PHONE_INTL_RE = re.compile(
    r"(?<![A-Za-z0-9_+])\+[1-9]\d{0,14}(?:[ .\-]?\(\d{1,4}\)[ .\-]?\d{1,6})?"
    r"(?:[ .\-]\d{1,6}){0,6}" + END
)
# North American numbering plan: area code and exchange start with 2-9 ("123-456-7890" is none).
PHONE_NANP_RE = re.compile(
    START + r"(?:1[ .\-])?(?:\([2-9]\d{2}\) ?|[2-9]\d{2}(?P<sep>[ .\-]))"
    r"[2-9]\d{2}(?(sep)(?P=sep)|[ .\-])\d{4}" + END
)
# National numbers with a trunk prefix 0 (UK, China landlines, most of Europe): at least one
# separator, 10-12 digits in all (so ZIP+4 "02139-4307" and dates like "01-02-2024" stay).
PHONE_TRUNK_RE = re.compile(START + r"(?:\(0\d{1,4}\)|0\d{1,4})(?:[ \-]\d{2,8}){1,4}" + END)
# Chinese mobile numbers: 1[3-9] and 9 more digits, bare or grouped 3-4-4.
PHONE_CN_MOBILE_RE = re.compile(START + r"1[3-9]\d(?:[ \-]?\d{4}){2}" + END)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_network_ok(digits: str) -> bool:
    """The number starts like a payment card: Visa 4, Mastercard 51-55/2221-2720, Amex 34/37,
    Discover 6011/644-649/65, UnionPay 62, JCB 3528-3589, Diners 300-305/36/38.

    Luhn alone passes one random number in ten; the issuer prefix cuts that further.
    """
    if digits[0] == "4":
        return True
    two, four = int(digits[:2]), int(digits[:4])
    return (
        51 <= two <= 55
        or 2221 <= four <= 2720
        or two in (34, 36, 37, 38, 62, 65)
        or four == 6011
        or 644 <= int(digits[:3]) <= 649
        or 3528 <= four <= 3589
        or 300 <= int(digits[:3]) <= 305
    )


# How printed card numbers are grouped: 16 as 4x4, 19 as 4x4+3, Amex 4-6-5, Diners 4-6-4. Other
# groupings of 13-19 digits (account numbers, the tail of a mistyped IBAN) are not cards.
CARD_GROUPINGS = {(4, 4, 4, 4), (4, 4, 4, 4, 3), (4, 6, 5), (4, 6, 4)}


def is_credit_card(candidate: str) -> bool:
    separators = set(re.sub(r"\d", "", candidate))
    if len(separators) > 1:
        return False
    if separators and tuple(map(len, re.split(r"[ \-]", candidate))) not in CARD_GROUPINGS:
        return False
    digits = re.sub(r"\D", "", candidate)
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and card_network_ok(digits) and luhn_ok(digits)


def iban_ok(compact: str) -> bool:
    """ISO 13616: the country's length, and the number mod 97 is 1 with the first four moved last."""
    if IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def cn_resident_id_ok(candidate: str) -> bool:
    body, check = candidate[:17], candidate[17].upper()
    try:
        birth = datetime.date(int(body[6:10]), int(body[10:12]), int(body[12:14]))
    except ValueError:
        return False  # 20230230 is shaped like a date but is none
    if birth > datetime.date.today():
        return False
    return CN_ID_CHECK[sum(int(d) * w for d, w in zip(body, CN_ID_WEIGHTS)) % 11] == check


def ssn_ok(area: str, group: str, serial: str) -> bool:
    # Never issued: area 000, 666 and 900-999, group 00, serial 0000.
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def ip_ok(candidate: str, public_only: bool) -> bool:
    try:
        ip = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    if ip.version == 6 and "::" in candidate and len([g for g in candidate.split(":") if g]) < 3:
        return False  # "a::b", "fe::1" are far more often code (C++/Rust paths) than addresses
    # Multicast groups (224.0.0.0/4) are shared protocol addresses, not anyone's host.
    return (ip.is_global and not ip.is_multicast) if public_only else True


def phone_digits_ok(candidate: str, low: int, high: int) -> bool:
    return low <= sum(ch.isdigit() for ch in candidate) <= high


def _sub(pattern: re.Pattern, text: str, token: str, check) -> tuple[str, int]:
    hits = 0

    def replace(m: re.Match) -> str:
        nonlocal hits
        if check(m):
            hits += 1
            return token
        return m.group(0)

    return pattern.sub(replace, text), hits


def _sub_iban(text: str) -> tuple[str, int]:
    hits = 0

    def replace(m: re.Match) -> str:
        # The candidate may run on into following capitals ("... 0130 00 IN EUR"): take exactly the
        # country's length of characters and keep the rest, if that prefix ends at a group boundary.
        nonlocal hits
        s = m.group(0)
        length = IBAN_LENGTHS.get(s[:2])
        if length is None:
            return s
        seen = 0
        for i, ch in enumerate(s):
            seen += ch != " "
            if seen == length:
                end = i + 1
                if (end == len(s) or s[end] == " ") and iban_ok(s[:end].replace(" ", "")):
                    hits += 1
                    return PII_TOKENS["iban"] + s[end:]
                return s
        return s

    return IBAN_RE.sub(replace, text), hits


def _sub_cards(text: str) -> tuple[str, int]:
    hits = 0

    def replace(m: re.Match) -> str:
        # A grouped card followed by another short number ("4111 1111 1111 1111 123") is one
        # candidate; try it whole, then without its trailing groups.
        nonlocal hits
        s = m.group(0)
        groups = re.split(r"([ \-])", s)  # digits, separator, digits, ...
        for k in range(len(groups), 0, -2):
            prefix = "".join(groups[:k])
            if is_credit_card(prefix):
                hits += 1
                return PII_TOKENS["credit_card"] + s[len(prefix) :]
        return s

    return CARD_RE.sub(replace, text), hits


def scrub_pii(
    text: str, types: tuple[str, ...] | list[str] = PII_TYPES, public_ips_only: bool = True
) -> tuple[str, Counter]:
    """Replace each kind of personal data in `types` by its typed token; return text and hits per kind."""
    hits: Counter = Counter()
    if "email" in types and "@" in text:
        text, hits["email"] = _sub(EMAIL_RE, text, PII_TOKENS["email"], lambda m: True)
    if "ip" in types:
        n4 = n6 = 0
        if "." in text:
            text, n4 = _sub(IPV4_RE, text, PII_TOKENS["ip"], lambda m: ip_ok(m.group(0), public_ips_only))
        if "::" in text or text.count(":") >= 7:
            text, n6 = _sub(IPV6_RE, text, PII_TOKENS["ip"], lambda m: ip_ok(m.group(0), public_ips_only))
        hits["ip"] = n4 + n6
    if "iban" in types:
        text, hits["iban"] = _sub_iban(text)
    if "id" in types:
        text, n_cn = _sub(CN_ID_RE, text, PII_TOKENS["id"], lambda m: cn_resident_id_ok(m.group(0)))
        text, n_ssn = _sub(SSN_RE, text, PII_TOKENS["id"], lambda m: ssn_ok(m[1], m[3], m[4]))
        text, n_nino = _sub(NINO_RE, text, PII_TOKENS["id"], lambda m: m[1] not in NINO_BAD_PREFIXES)
        hits["id"] = n_cn + n_ssn + n_nino
    if "credit_card" in types:
        text, hits["credit_card"] = _sub_cards(text)
    if "phone" in types:
        n = 0
        for pattern, low, high in (
            (PHONE_INTL_RE, 8, 15),
            (PHONE_NANP_RE, 10, 11),
            (PHONE_TRUNK_RE, 10, 12),
            (PHONE_CN_MOBILE_RE, 11, 11),
        ):
            text, k = _sub(
                pattern, text, PII_TOKENS["phone"], lambda m, low=low, high=high: phone_digits_ok(m.group(0), low, high)
            )
            n += k
        hits["phone"] = n
    return text, +hits  # unary plus drops the kinds with no hits


@register
@dataclass
class PII(Filter):
    """Scrub personal data in place; drop documents with more than `max_hits` hits.

    A Filter rather than a Mapper so it can drop: `reason()` always rewrites `doc["text"]` first,
    so even a dropped document reaches rejected/ already scrubbed. Hits per kind go to
    `doc["meta"]["pii"]` (only when there are any) and to the step's counters.
    """

    name = "pii"
    max_hits: int = 0  # 0: never drop, only scrub (Dolma drops above 5)
    types: list[str] = field(default_factory=lambda: list(PII_TYPES))
    public_ips_only: bool = True  # private/loopback/documentation IPs identify no one

    def validate(self) -> None:
        if self.max_hits < 0:
            raise ConfigError("max_hits", f"must be >= 0 (0 never drops), got {self.max_hits}")
        unknown = [t for t in self.types if t not in PII_TYPES]
        if unknown:
            raise ConfigError(
                "types", f"unknown kind(s) {', '.join(map(repr, unknown))}; known: {', '.join(PII_TYPES)}"
            )

    def reason(self, doc: dict) -> str | None:
        text, hits = scrub_pii(doc["text"], self.types, self.public_ips_only)
        if not hits:
            return None
        doc["text"] = text
        doc["meta"]["pii"] = dict(hits)
        for kind, n in hits.items():
            self.stats.count(kind, n)
        if self.max_hits and sum(hits.values()) > self.max_hits:
            return "pii_too_many"
        return None
