"""Message sizes as the benchmarks read and print them ("4K", "16M")."""


def parse_size(text: str) -> int:
    """Bytes from "4096", "4K", "16MB" or "1G"."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def fmt_size(nbytes: int) -> str:
    """"16M", "4K" or "512B"."""
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
