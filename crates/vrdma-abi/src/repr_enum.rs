//! [`repr_enum!`]: one definition for the fieldless enums whose values cross a process or
//! host boundary (verbs statuses and opcodes, frame kinds, NAK codes, control operations).
//!
//! Each such enum needs its variants twice: as discriminants, to encode with `as`, and as
//! a table from the raw integer back to the variant, to decode untrusted input. Written by
//! hand the two drift apart; here the macro writes the decoding table from the enum itself.

/// Defines a fieldless `#[repr(int)]` enum and the checked decoder of its raw values.
///
/// ```text
/// repr_enum! {
///     /// Doc comments and other attributes (more derives) pass through.
///     #[derive(PartialOrd, Ord)]
///     pub enum Colour: u8 {
///         /// Variant docs pass through too.
///         Red = 1,
///         Green = 2,
///     }
///     /// The decoder's own doc comment.
///     pub fn from_u32(u32);
/// }
/// ```
///
/// expands to the enum with `#[repr(u8)]`, the derives every such enum has (`Clone, Copy,
/// Debug, PartialEq, Eq, Hash`) and `impl Colour { pub fn from_u32(v: u32) ->
/// Option<Colour> }`, which returns `None` for any value that is not a discriminant. The
/// decoder's integer type may be wider than the `repr` (a verbs enum stored as a byte but
/// passed as `u32` by the API): a value out of the `repr`'s range is simply unknown. Encoding
/// stays `variant as u8`. Under `cfg(test)` the enum also gets `VARIANTS`, every variant in
/// declaration order, for round-trip tests.
macro_rules! repr_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $(
                $(#[$variant_meta:meta])*
                $variant:ident = $value:literal
            ),+ $(,)?
        }
        $(#[$decoder_meta:meta])*
        $decoder_vis:vis fn $decoder:ident($raw:ty);
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        $vis enum $name {
            $(
                $(#[$variant_meta])*
                $variant = $value,
            )+
        }

        impl $name {
            $(#[$decoder_meta])*
            $decoder_vis fn $decoder(v: $raw) -> Option<Self> {
                match v {
                    $($value => Some(Self::$variant),)+
                    _ => None,
                }
            }

            /// Every variant, in declaration order.
            #[cfg(test)]
            #[allow(dead_code)]
            pub(crate) const VARIANTS: &'static [Self] = &[$(Self::$variant),+];
        }
    };
}

pub(crate) use repr_enum;

#[cfg(test)]
mod tests {
    repr_enum! {
        /// A test enum with gaps, a high value and a decoder wider than its repr.
        enum Sample: u8 {
            /// The first.
            Zero = 0,
            Two = 2,
            High = 255,
        }
        /// Decodes a raw word.
        fn from_u32(u32);
    }

    repr_enum! {
        pub(crate) enum Wide: u32 {
            Big = 0x8000_0000,
            Small = 7,
        }
        pub(crate) fn from_u32(u32);
    }

    #[test]
    fn discriminants_are_the_declared_values() {
        assert_eq!(Sample::Zero as u8, 0);
        assert_eq!(Sample::Two as u8, 2);
        assert_eq!(Sample::High as u8, 255);
        assert_eq!(Wide::Big as u32, 0x8000_0000);
        assert_eq!(std::mem::size_of::<Sample>(), 1);
        assert_eq!(std::mem::size_of::<Wide>(), 4);
    }

    #[test]
    fn every_variant_round_trips() {
        assert_eq!(Sample::VARIANTS, [Sample::Zero, Sample::Two, Sample::High]);
        for &v in Sample::VARIANTS {
            assert_eq!(Sample::from_u32(u32::from(v as u8)), Some(v));
        }
        for &v in Wide::VARIANTS {
            assert_eq!(Wide::from_u32(v as u32), Some(v));
        }
    }

    #[test]
    fn unknown_values_are_rejected() {
        for raw in [1, 3, 254, 256, 0x1ff, u32::MAX] {
            assert_eq!(Sample::from_u32(raw), None, "{raw}");
        }
        for raw in [0, 6, 8, 0x7fff_ffff, 0x8000_0001] {
            assert_eq!(Wide::from_u32(raw), None, "{raw}");
        }
    }
}
