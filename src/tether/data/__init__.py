"""Data: rows read from files or the hub (`rows`), chat rendering (`chat`), the row shapes each
stage reads (`shapes`), the one encoding rule every stage shares (`encoding`), generation prompts
(`prompts`) and batches of encoded rows (`batches`). No models here: text and token ids in,
tensors out."""
