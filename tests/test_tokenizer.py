from frontier.tokenizer import BOS, Tokenizer, train_tokenizer

TEXT = ["The café served crème brûlée.", "漢字 and emoji 🚀 mix with ASCII.", "naïve façade " * 20]


def test_token_bytes_sum_to_the_utf8_length():
    tokenizer = train_tokenizer(TEXT * 50, vocab_size=300)
    for text in TEXT + ["unseen: Zürich – 東京 ✓"]:
        ids = tokenizer.encode(text)
        assert int(tokenizer.token_bytes[ids].sum()) == len(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text


def test_bos_is_special_and_has_no_bytes(tmp_path):
    tokenizer = train_tokenizer(TEXT, vocab_size=280)
    assert tokenizer.vocab_size == 280
    assert tokenizer.token_bytes[tokenizer.bos_id] == 0
    assert BOS not in tokenizer.decode(tokenizer.encode("plain text"))
    tokenizer.save(tmp_path / "tok.json")
    again = Tokenizer.load(tmp_path / "tok.json")
    assert again.fingerprint() == tokenizer.fingerprint() and again.bos_id == tokenizer.bos_id
