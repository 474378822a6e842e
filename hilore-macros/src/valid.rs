//! Compile-time checks of a `deterministic` unit's body: no obvious nondeterminism.
//!
//! A deterministic unit may be recomputed in backward and must then reproduce its forward
//! bit for bit, so it cannot read clocks or draw from unseeded RNGs. Randomness must come
//! from the tape's counter-based generator (`cx.counter_uniform`, `cx.dropout`), which
//! replays identically. The check is syntactic: it catches the obvious sources.

use crate::ctxt::Ctxt;
use syn::visit::Visit;

/// Path segments that mark nondeterminism, and the reason.
const FORBIDDEN: &[(&str, &str)] = &[
    ("thread_rng", "a thread RNG draws different values on recompute"),
    ("ThreadRng", "a thread RNG draws different values on recompute"),
    ("OsRng", "the OS RNG draws different values on recompute"),
    ("getrandom", "the OS RNG draws different values on recompute"),
    ("from_entropy", "an RNG seeded from entropy draws different values on recompute"),
    ("SystemTime", "the clock reads differently on recompute"),
    ("Instant", "the clock reads differently on recompute"),
    ("RandomState", "a randomly seeded hasher iterates differently on recompute; use `BTreeMap`"),
    ("HashMap", "`HashMap` iterates in a random order that differs on recompute; use `BTreeMap` or a `Vec`"),
    ("HashSet", "`HashSet` iterates in a random order that differs on recompute; use `BTreeSet` or a `Vec`"),
];

/// Function names (path tails or methods) of unseeded tensor RNGs.
const FORBIDDEN_CALLS: &[&str] = &["randn", "rand", "randn_like", "rand_like", "random", "rng"];

struct Finder<'a> {
    cx: &'a mut Ctxt,
}

const FIX: &str = "a `deterministic` recovery unit is re-run on recompute and must reproduce its forward bit for bit; draw randomness from the tape (`cx.counter_uniform(..)`, `cx.dropout(..)`), which replays identically, or drop `deterministic`";

impl Finder<'_> {
    fn path(&mut self, path: &syn::Path) {
        for seg in &path.segments {
            let s = seg.ident.to_string();
            if let Some((_, why)) = FORBIDDEN.iter().find(|(n, _)| *n == s) {
                self.cx.error_spanned_by(&seg.ident, format!("nondeterminism in a deterministic unit: `{s}`: {why}; {FIX}"));
                return;
            }
        }
        if path.segments.len() >= 2 {
            let last = path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
            if FORBIDDEN_CALLS.contains(&last.as_str()) {
                let seg = &path.segments.last().unwrap().ident;
                self.cx.error_spanned_by(seg, format!("nondeterminism in a deterministic unit: `{}` draws from an unseeded RNG; {FIX}", quote::quote!(#path).to_string().replace(' ', "")));
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
        if name == "randn_like" || name == "rand_like" {
            self.cx.error_spanned_by(&m.method, format!("nondeterminism in a deterministic unit: `.{name}()` draws from an unseeded RNG; {FIX}"));
        }
        syn::visit::visit_expr_method_call(self, m);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.path(&m.path);
        // Look inside macro calls whose arguments parse as expressions (println!, vec!, ...).
        if let Ok(args) = m.parse_body_with(syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated) {
            for a in &args {
                self.visit_expr(a);
            }
        }
    }
}

pub(crate) fn check_deterministic(cx: &mut Ctxt, block: &syn::Block) {
    Finder { cx }.visit_block(block);
}
