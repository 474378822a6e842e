//! The decoder's units are registered in any binary that links the crate: registrations
//! made with `inventory` can be dropped by the linker when nothing references the code
//! that submits them, and then `hilore units` and plan validation would silently miss
//! them. This test references nothing but the unit names.

use hilore_models::plans::{LAYER_UNITS, UNIT_NAMES};
use std::collections::BTreeSet;

#[test]
fn all_ten_units_are_registered() {
    let units: Vec<_> = hilore_runtime::registered_units()
        .into_iter()
        .filter(|u| u.module.starts_with("hilore_models"))
        .collect();
    let names: BTreeSet<&str> = units.iter().map(|u| u.name).collect();
    assert_eq!(units.len(), 10, "registered: {names:?}");
    assert_eq!(names, UNIT_NAMES.iter().copied().collect::<BTreeSet<_>>());
    assert!(LAYER_UNITS.iter().all(|u| names.contains(u)));
    for u in &units {
        assert!(
            u.deterministic,
            "{} must be deterministic (it is offered Recompute)",
            u.name
        );
        assert!(u.codecs.is_none(), "{} restricts its codecs", u.name);
    }
}
