"""TEST DOUBLE of FlashInfer (not FlashInfer): only ``flashinfer.comm``'s all-reduce fusion entry points."""

IS_TEST_DOUBLE = True
