//! Small closed sets of named values (weight formats, cache types, reasoning efforts) that the
//! config file, the command line and the settings panel all name the same way.

/// Gives a fieldless enum `ALL`, `NAMES`, `name`, `from_name`, `cycle` and `Display` from one table of
/// variant names.
macro_rules! impl_choice {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value, in the order the settings panel cycles through them.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The names of [`Self::ALL`], in the same order.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// The lower-case name used in the config file, on the command line and on screen.
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }

            /// Parses [`Self::name`]; `None` for anything else.
            pub fn from_name(text: &str) -> Option<$ty> {
                Self::ALL.iter().copied().find(|value| value.name() == text)
            }

            /// The next value in [`Self::ALL`] (`step` = 1) or the previous one (`step` = -1), wrapping.
            pub fn cycle(self, step: isize) -> $ty {
                let index = Self::ALL.iter().position(|value| *value == self).unwrap_or(0) as isize;
                let count = Self::ALL.len() as isize;
                Self::ALL[(index + step).rem_euclid(count) as usize]
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str(self.name())
            }
        }
    };
}

pub(crate) use impl_choice;
