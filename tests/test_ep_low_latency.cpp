// placeholder: low-latency tests (being written)
