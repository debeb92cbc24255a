import pickle

import pytest

from kiln.data.steps.pii import PII, cn_resident_id_ok, iban_ok, is_credit_card, luhn_ok, scrub_pii, ssn_ok
from kiln.errors import ConfigError


def scrub(text, **kw):
    return scrub_pii(text, **kw)


@pytest.mark.parametrize(
    "text, kind, placeholder",
    [
        ("write to john.doe+tag@example.co.uk today", "email", "<EMAIL>"),
        ("联系邮箱abc@mail.example.cn谢谢", "email", "<EMAIL>"),
        ("resolver 8.8.8.8 answered", "ip", "<IP>"),
        ("resolver 2001:4860:4860::8888 answered", "ip", "<IP>"),
        ("mapped ::ffff:8.8.4.4 here", "ip", "<IP>"),
        ("card 4111 1111 1111 1111 expires", "credit_card", "<CREDIT_CARD>"),
        ("card 5500-0000-0000-0004 expires", "credit_card", "<CREDIT_CARD>"),
        ("amex 3782 822463 10005 expires", "credit_card", "<CREDIT_CARD>"),
        ("card 4111111111111111 expires", "credit_card", "<CREDIT_CARD>"),
        ("pay to DE89 3704 0044 0532 0130 00 now", "iban", "<IBAN>"),
        ("pay to GB82WEST12345698765432 now", "iban", "<IBAN>"),
        ("pay to NL91ABNA0417164300 now", "iban", "<IBAN>"),
        ("ssn 123-45-6789 on file", "id", "<ID>"),
        ("NINO AB 12 34 56 C on file", "id", "<ID>"),
        ("身份证号11010519491231002X。", "id", "<ID>"),
        ("call +1 (415) 555-2671 now", "phone", "<PHONE>"),
        ("call +44 20 7946 0958 now", "phone", "<PHONE>"),
        ("call +8613800138000 now", "phone", "<PHONE>"),
        ("call (415) 555-2671 now", "phone", "<PHONE>"),
        ("call 415.555.2671 now", "phone", "<PHONE>"),
        ("call 1-800-555-0199 now", "phone", "<PHONE>"),
        ("call 020 7946 0958 now", "phone", "<PHONE>"),
        ("电话010-12345678，手机13800138000", "phone", "<PHONE>"),
        ("手机 138 0013 8000", "phone", "<PHONE>"),
    ],
)
def test_true_positives(text, kind, placeholder):
    out, hits = scrub(text)
    assert placeholder in out and set(hits) == {kind}, (out, hits)
    assert not any(ch.isdigit() for ch in out.split(placeholder)[0][-1:])  # nothing left glued on


@pytest.mark.parametrize(
    "text",
    [
        "Python 3.11.7, version 1.2.3, release 2.0.0-rc1, v1.2.3.4",
        "dates 2024-01-15, 15.01.2024, 12/31/2024, 01-02-2024, 2024/01/15",
        "format example +000000120, multicast 224.0.0.251, time 12:30:45, MAC 00:1A:2B:3C:4D:5E, C++ std::vector, Rust a::b, fe::1",
        "private 192.168.1.1, loopback 127.0.0.1, doc range 192.0.2.7 and 2001:db8::1, link fe80::1",
        "not an address 999.1.1.1 or 1.2.3",
        "random 16 digits 4111 1111 1111 1112 and 1234567812345678 and 0000000000000000",
        "luhn-valid but no card network 1000000000000008, or grouped oddly 4111 111 111 111 111",
        "IBAN with a bad checksum DE89 3704 0044 0532 0130 01 and GB82WEST12345698765433",
        "SSN never issued 000-12-3456, 666-12-3456, 912-34-5678, 123-00-4567, 123-45-0000",
        "bad Chinese ids 110105194912310021 (check char) and 110105194902300028 (Feb 30)",
        "not phones: 123-456-7890, ZIP+4 02139-4307, ISBN 978-3-16-148410-0, 1,234,567, +1 500 000",
        "pi 3.14159265358979323846, timestamp 1700000000000 and 1700000000, id 12345678901234567",
        "user@localhost and @decorator and foo@bar",
        "NINO prefixes never issued: GB 12 34 56 C, QQ 12 34 56 C",
    ],
)
def test_tricky_negatives(text):
    out, hits = scrub(text)
    assert out == text and not hits, (out, hits)


def test_checksums_directly():
    assert luhn_ok("79927398713") and not luhn_ok("79927398710")
    assert is_credit_card("4012888888881881") and not is_credit_card("4012888888881882")
    assert iban_ok("DE89370400440532013000") and not iban_ok("DE89370400440532013001")
    assert not iban_ok("DE8937040044053201300")  # one character short for Germany
    assert cn_resident_id_ok("11010519491231002X") and cn_resident_id_ok("11010519491231002x")
    assert not cn_resident_id_ok("110105194912310021")
    assert ssn_ok("123", "45", "6789") and not ssn_ok("900", "45", "6789")


def test_iban_stops_at_its_length():
    out, hits = scrub("DE89 3704 0044 0532 0130 00 IN EUR")
    assert out == "<IBAN> IN EUR" and hits == {"iban": 1}


def test_grouped_card_followed_by_number():
    out, hits = scrub("4111 1111 1111 1111 123")
    assert out == "<CREDIT_CARD> 123" and hits == {"credit_card": 1}


def test_private_ips_on_request():
    out, hits = scrub("host 192.168.1.1 and 2001:db8::1", public_ips_only=False)
    assert out == "host <IP> and <IP>" and hits == {"ip": 2}


def test_types_subset():
    text = "a@b.com 8.8.8.8"
    assert scrub(text, types=["ip"]) == ("a@b.com <IP>", {"ip": 1})


def test_real_text_untouched():
    # Python's reference documentation is full of version numbers, example addresses, format
    # strings, dates and code, and holds no personal data: scrubbing must leave all of it alone.
    from pydoc_data.topics import topics

    text = "\n".join(topics.values())
    out, hits = scrub(text)
    assert not hits and out == text, hits


def make(text):
    return {"id": "d", "text": text, "source": "s", "meta": {}}


def test_filter_scrubs_counts_and_drops():
    step = PII(max_hits=2)
    step.validate()
    doc = make("mail a@example.com or b@example.org, call +44 20 7946 0958")
    assert step.reason(doc) == "pii_too_many"
    # Scrubbed even when dropped, so rejected/ holds no personal data either.
    assert doc["text"] == "mail <EMAIL> or <EMAIL>, call <PHONE>"
    assert doc["meta"]["pii"] == {"email": 2, "phone": 1}
    doc2 = make("one address: c@example.com and two: d@example.com")
    assert step.reason(doc2) is None and doc2["meta"]["pii"] == {"email": 2}
    assert step.stats.counters == {"email": 4, "phone": 1}
    clean = make("nothing personal here")
    assert step.reason(clean) is None and clean == make("nothing personal here")


def test_filter_never_drops_by_default():
    step = PII()
    doc = make(" ".join(f"u{i}@example.com" for i in range(50)))
    assert step.reason(doc) is None and doc["meta"]["pii"] == {"email": 50}


def test_validate_and_pickle():
    with pytest.raises(ConfigError, match="max_hits"):
        PII(max_hits=-1).validate()
    with pytest.raises(ConfigError, match="types"):
        PII(types=["email", "passport"]).validate()
    step = pickle.loads(pickle.dumps(PII(max_hits=3)))
    assert step.max_hits == 3
