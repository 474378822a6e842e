//! Compile-time checks of a `deterministic` unit's body: no obvious nondeterminism.
//!
//! A deterministic unit may be recomputed in backward and must then reproduce its forward
//! bit for bit, so it cannot read clocks or draw from unseeded RNGs. Randomness must come
//! from the tape's counter-based generator (`cx.counter_uniform`, `cx.dropout`), which
//! replays identically.
//!
//! The check is syntactic, over the unit's own body. It catches:
//! - clocks, OS and thread RNGs, unseeded tensor RNGs, by name, also when a `use` inside
//!   the body renames them (`use rand::rng as my_rng`);
//! - state that outlives the unit mutated from its body: `Cell` / `RefCell` / atomic
//!   writes (`.set`, `.replace`, `.borrow_mut`, `.fetch_add`, `.store`, ...) on `self.x`
//!   or on a `STATIC`;
//! - `HashMap` / `HashSet` in a body that iterates (a `for` loop, `.iter()`, `.keys()`,
//!   `.values()`, `.drain()`, ...); lookups alone are allowed.
//!
//! It cannot see what the body reaches indirectly: helper functions and methods it calls,
//! aliases and `use` renames outside the body, type aliases of a `HashMap`. The run-time
//! recompute check (`Cx::verify_recompute`, `hilore check`) catches those: a
//! recompute that differs fails with `NotBitIdentical`, naming the unit and the op.

use crate::ctxt::Ctxt;
use syn::visit::Visit;

/// What a `deterministic` unit is, said once in every message.
const WHY: &str =
    "a `deterministic` unit is re-run in backward and must reproduce its forward bit for bit";

/// The fix for randomness.
const RNG_FIX: &str = "draw randomness from the tape's counter-based RNG (`cx.counter_uniform(..)`, `cx.dropout(..)`), which replays identically, or remove `deterministic`";

/// Path segments that mark nondeterminism: what they do, and the fix.
const FORBIDDEN: &[(&str, &str, &str)] = &[
    ("thread_rng", "draws from a thread RNG, which gives other values on recompute", RNG_FIX),
    ("ThreadRng", "is a thread RNG, which gives other values on recompute", RNG_FIX),
    ("OsRng", "draws from the OS RNG, which gives other values on recompute", RNG_FIX),
    ("getrandom", "draws from the OS RNG, which gives other values on recompute", RNG_FIX),
    ("from_entropy", "seeds an RNG from entropy, which gives other values on recompute", RNG_FIX),
    ("from_os_rng", "seeds an RNG from the OS, which gives other values on recompute", RNG_FIX),
    (
        "SystemTime",
        "reads the clock, which reads differently on recompute",
        "compute time-dependent values outside the unit and pass them in as a `Var` or a `Copy` input, or remove `deterministic`",
    ),
    (
        "Instant",
        "reads the clock, which reads differently on recompute",
        "time the unit from outside its body, or pass time-dependent values in as a `Var` or a `Copy` input, or remove `deterministic`",
    ),
    (
        "RandomState",
        "seeds a hasher randomly, so iteration order differs on recompute",
        "use a `BTreeMap` or a `Vec`, or remove `deterministic`",
    ),
];

/// Function names (path tails like `Tensor::randn`, `rand::random`) of unseeded RNGs.
const FORBIDDEN_CALLS: &[&str] = &["randn", "rand", "randn_like", "rand_like", "random", "rng"];

/// Methods of unseeded tensor RNGs (`x.randn_like(..)`).
const FORBIDDEN_METHODS: &[&str] = &["randn_like", "rand_like"];

/// Writes to interior-mutable state (`Cell`, `RefCell`, atomics).
const MUTATORS: &[&str] = &[
    "set",
    "replace",
    "take",
    "borrow_mut",
    "get_mut",
    "fetch_add",
    "fetch_sub",
    "fetch_or",
    "fetch_and",
    "fetch_xor",
    "fetch_max",
    "fetch_min",
    "fetch_update",
    "store",
    "swap",
    "compare_exchange",
    "compare_exchange_weak",
];

/// Methods that iterate a collection (in a `HashMap`'s random order, if it is one).
const ITERATORS: &[&str] = &[
    "iter",
    "iter_mut",
    "into_iter",
    "keys",
    "values",
    "values_mut",
    "into_keys",
    "into_values",
    "drain",
    "retain",
];

struct Finder<'a> {
    cx: &'a mut Ctxt,
    /// `HashMap` / `HashSet` mentions, reported only if the body iterates.
    hashed: Vec<(proc_macro2::Span, String)>,
    iterates: bool,
}

/// Whether `e` is `self.field...` or a `STATIC` (a path whose last segment is upper case).
fn outlives_the_unit(e: &syn::Expr) -> Option<String> {
    match e {
        syn::Expr::Field(f) => {
            let mut base = &*f.base;
            while let syn::Expr::Field(inner) = base {
                base = &inner.base;
            }
            match base {
                syn::Expr::Path(p) if p.path.is_ident("self") => {
                    Some(crate::expand::render(quote::ToTokens::to_token_stream(e)))
                }
                _ => None,
            }
        }
        syn::Expr::Path(p) => {
            let last = p.path.segments.last()?.ident.to_string();
            let upper = last.chars().any(|c| c.is_ascii_uppercase())
                && !last.chars().any(|c| c.is_ascii_lowercase());
            upper.then_some(last)
        }
        syn::Expr::Paren(p) => outlives_the_unit(&p.expr),
        syn::Expr::Reference(r) => outlives_the_unit(&r.expr),
        _ => None,
    }
}

impl Finder<'_> {
    fn path(&mut self, path: &syn::Path) {
        for seg in &path.segments {
            let s = seg.ident.to_string();
            if s == "HashMap" || s == "HashSet" {
                self.hashed.push((seg.ident.span(), s));
                return;
            }
            if let Some((_, what, fix)) = FORBIDDEN.iter().find(|(n, _, _)| *n == s) {
                self.cx
                    .error_spanned_by(&seg.ident, format!("`{s}` {what}: {WHY}; {fix}"));
                return;
            }
        }
        if let [.., _, last] = path.segments.iter().collect::<Vec<_>>()[..] {
            let name = last.ident.to_string();
            if FORBIDDEN_CALLS.contains(&name.as_str()) {
                let text = crate::expand::render(quote::ToTokens::to_token_stream(path));
                self.cx.error_spanned_by(
                    path,
                    format!("`{text}` draws from an unseeded RNG, which gives other values on recompute: {WHY}; {RNG_FIX}"),
                );
            }
        }
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.path(p);
        syn::visit::visit_path(self, p);
    }

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        let name = m.method.to_string();
        if ITERATORS.contains(&name.as_str()) {
            self.iterates = true;
        }
        if MUTATORS.contains(&name.as_str()) {
            if let Some(what) = outlives_the_unit(&m.receiver) {
                self.cx.error_spanned_by(
                    &m.method,
                    format!("`{what}.{name}(..)` changes state that outlives the unit, so a recompute sees the changed value: {WHY}; keep the state outside the unit (pass what it decides in as an input), or remove `deterministic`"),
                );
            }
        }
        if FORBIDDEN_METHODS.contains(&name.as_str()) {
            self.cx.error_spanned_by(
                &m.method,
                format!("`.{name}()` draws from an unseeded RNG, which gives other values on recompute: {WHY}; {RNG_FIX}"),
            );
        }
        syn::visit::visit_expr_method_call(self, m);
    }

    fn visit_expr_for_loop(&mut self, f: &'ast syn::ExprForLoop) {
        self.iterates = true;
        syn::visit::visit_expr_for_loop(self, f);
    }

    fn visit_use_tree(&mut self, t: &'ast syn::UseTree) {
        let ident = match t {
            syn::UseTree::Name(n) => Some(&n.ident),
            syn::UseTree::Rename(r) => Some(&r.ident),
            _ => None,
        };
        if let Some(i) = ident {
            let s = i.to_string();
            if let Some((_, what, fix)) = FORBIDDEN.iter().find(|(n, _, _)| *n == s) {
                self.cx
                    .error_spanned_by(i, format!("`{s}` {what}: {WHY}; {fix}"));
            } else if FORBIDDEN_CALLS.contains(&s.as_str()) {
                self.cx.error_spanned_by(
                    i,
                    format!("`use` of `{s}` brings in an unseeded RNG, which gives other values on recompute: {WHY}; {RNG_FIX}"),
                );
            }
        }
        syn::visit::visit_use_tree(self, t);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.path(&m.path);
        // Look inside macro calls whose arguments parse as expressions (println!, vec!, ...).
        if let Ok(args) = m.parse_body_with(
            syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated,
        ) {
            for a in &args {
                self.visit_expr(a);
            }
        }
    }
}

pub(crate) fn check_deterministic(cx: &mut Ctxt, block: &syn::Block) {
    let mut f = Finder {
        cx,
        hashed: Vec::new(),
        iterates: false,
    };
    f.visit_block(block);
    if f.iterates {
        for (span, s) in std::mem::take(&mut f.hashed) {
            let fix = if s == "HashMap" {
                "BTreeMap"
            } else {
                "BTreeSet"
            };
            f.cx.error_at(
                span,
                format!("`{s}` iterates in a random order that differs on recompute, and this body iterates: {WHY}; use a `{fix}` or a `Vec` (lookups alone in a `{s}` are fine), or remove `deterministic`"),
            );
        }
    }
}
