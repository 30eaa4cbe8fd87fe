"""Model files read from their headers: shapes, sizes, checks, and the tokenizer."""
