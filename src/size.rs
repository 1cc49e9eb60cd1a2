//! Parsing of human-written sizes: `4096`, `512K`, `1G`, `2T` (powers of 1024).

/// Parses a byte count with an optional K, M, G or T suffix (powers of 1024; a trailing
/// `B` or `iB` is accepted, case does not matter).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let upper = trimmed.to_ascii_uppercase();
    let without_b = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, shift) = match without_b.chars().last() {
        Some('K') => (&without_b[..without_b.len() - 1], 10),
        Some('M') => (&without_b[..without_b.len() - 1], 20),
        Some('G') => (&without_b[..without_b.len() - 1], 30),
        Some('T') => (&without_b[..without_b.len() - 1], 40),
        _ => (without_b, 0),
    };
    let digits = digits.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{text:?} is not a size (examples: 4096, 512K, 1G, 2T)"
        ));
    }
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("2T").unwrap(), 2 << 40);
        assert_eq!(parse_size(" 3M ").unwrap(), 3 << 20);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for bad in [
            "",
            "G",
            "1.5G",
            "-1",
            "12Q",
            "99999999999999999999",
            "16777216T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad} should be refused");
        }
    }
}
