"""One module per op family; the package imports each of them (see the provider's ``__init__``)."""
