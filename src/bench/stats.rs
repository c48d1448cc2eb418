//! Min, median and max of repeated measurements.

use serde::Serialize;

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Summary {
    /// Summary of `values`; all zero when there are none. The median of an even count is the
    /// mean of the two middle values.
    pub fn of(values: &[f64]) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Summary {
            min: sorted[0],
            median,
            max: sorted[n - 1],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(Summary::of(&[3.0, 1.0, 2.0]), Summary { min: 1.0, median: 2.0, max: 3.0 });
        assert_eq!(Summary::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(Summary::of(&[]), Summary::default());
    }
}
