//! Collects errors so one build reports every mistake (serde_derive's `Ctxt`).

use std::fmt::Display;

#[derive(Default)]
pub(crate) struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    pub(crate) fn error_spanned_by<T: quote::ToTokens, M: Display>(&mut self, tokens: T, msg: M) {
        self.errors.push(syn::Error::new_spanned(tokens, msg));
    }

    pub(crate) fn error_at<M: Display>(&mut self, span: proc_macro2::Span, msg: M) {
        self.errors.push(syn::Error::new(span, msg));
    }

    /// All errors combined into one, or `Ok` if there were none.
    pub(crate) fn check(self) -> Result<(), syn::Error> {
        let mut iter = self.errors.into_iter();
        let Some(mut first) = iter.next() else {
            return Ok(());
        };
        for e in iter {
            first.combine(e);
        }
        Err(first)
    }
}
