"""Text and pairs in, validated token requests out: the tokenizer, token slices, query-document
pairs, long-input windows."""
