//! Code generation.
//!
//! The annotated function keeps its name, visibility, attributes and signature (plus the
//! model lifetime `'m` on `&self` and `Cx`); its body becomes:
//!
//! - a `'static` descriptor, registered with `inventory`;
//! - the cost, evaluated on the live inputs;
//! - the original body as a closure over the parameters (the recompute path);
//! - captures of every input (checked to be `Replayable`, spanned on the user's types);
//! - a call to the runtime's `run_unit`, which opens the unit scope, runs the body through
//!   the same replay path a recompute uses (so forward and recompute cannot drift apart),
//!   and closes the scope under the plan's fidelity.
//!
//! Every path into the runtime is absolute (`::hilore_runtime::...`), through its hidden
//! `__private` module where it is not public API; inside the runtime itself
//! `extern crate self as hilore_runtime;` makes the same paths resolve.

use crate::ast::{self, ParamRole, Signature};
use crate::attr::{self, Args};
use crate::ctxt::Ctxt;
use crate::valid;
use proc_macro2::{Delimiter, Group, Ident, Punct, Spacing, Span, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::ItemFn;

pub(crate) fn recovery_unit(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let args = attr::parse(&mut cx, args);
    let Some(f) = parse_fn(&mut cx, &item) else {
        return fallback(cx, item);
    };
    if args.cost.is_none() && !args.cost_reported {
        cx.error_at(
            Span::call_site(),
            "missing `cost = <expr>`: the allocator needs each unit's cost estimate before anything is measured; add it, e.g. `#[recovery_unit(cost = 2 * x.elem_count(), deterministic)]`",
        );
    }
    let sig = ast::analyze(&mut cx, &f);
    if args.deterministic {
        valid::check_deterministic(&mut cx, &f.block);
    }
    if let Err(e) = cx.check() {
        // Keep the function as written so its callers still type-check: the build then
        // shows the macro's errors and nothing that follows from them.
        let mut ts = e.to_compile_error();
        f.to_tokens(&mut ts);
        return ts;
    }
    match expand(&args, &sig, &f) {
        Some(ts) => ts,
        None => {
            let mut ts = syn::Error::new(
                Span::call_site(),
                "`#[recovery_unit]` could not expand this function (an internal error of the macro: please report it)",
            )
            .to_compile_error();
            f.to_tokens(&mut ts);
            ts
        }
    }
}

/// The annotated item as a function, or an error that says what it is instead.
fn parse_fn(cx: &mut Ctxt, item: &TokenStream) -> Option<ItemFn> {
    if let Ok(f) = syn::parse2::<ItemFn>(item.clone()) {
        return Some(f);
    }
    const SHAPE: &str = "`fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var>`";
    if let Ok(f) = syn::parse2::<syn::TraitItemFn>(item.clone()) {
        cx.error_spanned_by(
            &f.sig,
            format!(
                "a recovery unit needs a body: put `#[recovery_unit]` on the method in each `impl`, not on a declaration without one ({SHAPE})"
            ),
        );
        return None;
    }
    fn kw_ident<K: ToTokens>(kw: &K, ident: &Ident) -> TokenStream {
        quote!(#kw #ident)
    }
    let (what, tokens) = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Struct(s)) => ("a struct", kw_ident(&s.struct_token, &s.ident)),
        Ok(syn::Item::Enum(e)) => ("an enum", kw_ident(&e.enum_token, &e.ident)),
        Ok(syn::Item::Union(u)) => ("a union", kw_ident(&u.union_token, &u.ident)),
        Ok(syn::Item::Trait(t)) => ("a trait", kw_ident(&t.trait_token, &t.ident)),
        Ok(syn::Item::Impl(i)) => {
            let (impl_token, self_ty) = (&i.impl_token, &i.self_ty);
            cx.error_spanned_by(
                quote!(#impl_token #self_ty),
                format!(
                    "`#[recovery_unit]` marks one function or method, not an `impl` block: put it on each method of the impl that should be a unit ({SHAPE})"
                ),
            );
            return None;
        }
        Ok(syn::Item::Mod(m)) => ("a module", kw_ident(&m.mod_token, &m.ident)),
        Ok(syn::Item::Const(c)) => ("a const", kw_ident(&c.const_token, &c.ident)),
        Ok(syn::Item::Static(s)) => ("a static", kw_ident(&s.static_token, &s.ident)),
        Ok(syn::Item::Type(t)) => ("a type alias", kw_ident(&t.type_token, &t.ident)),
        Ok(syn::Item::Use(u)) => ("a `use`", quote!(#u)),
        _ => ("this item", first_token(item)),
    };
    cx.error_spanned_by(
        tokens,
        format!(
            "`#[recovery_unit]` marks a function or method, not {what}: put it on the function that runs the forward ({SHAPE})"
        ),
    );
    None
}

fn first_token(ts: &TokenStream) -> TokenStream {
    ts.clone().into_iter().take(1).collect()
}

/// What to emit when the item is not a function: the errors and the item unchanged.
fn fallback(cx: Ctxt, item: TokenStream) -> TokenStream {
    let mut ts = match cx.check() {
        Ok(()) => TokenStream::new(),
        Err(e) => e.to_compile_error(),
    };
    ts.extend(item);
    ts
}

/// The spans of the first and the last token of `t`: generated code built with the first
/// at its start and the second at its end is reported on exactly the user's tokens.
fn span_range<T: ToTokens>(t: &T) -> (Span, Span) {
    let ts = t.to_token_stream();
    let mut iter = ts.into_iter();
    let first = iter
        .next()
        .map(|t| t.span())
        .unwrap_or_else(Span::call_site);
    let last = iter.last().map(|t| t.span()).unwrap_or(first);
    (first, last)
}

/// `ty` with every lifetime replaced by `'_` (the body closure takes its inputs by any
/// borrow: on recompute they are borrowed from the unit's captures).
fn erase_lifetimes(ts: TokenStream) -> TokenStream {
    let mut out = Vec::new();
    let mut after_quote = false;
    for t in ts {
        let t = match t {
            TokenTree::Group(g) => {
                let mut ng = Group::new(g.delimiter(), erase_lifetimes(g.stream()));
                ng.set_span(g.span());
                TokenTree::Group(ng)
            }
            TokenTree::Ident(i) if after_quote => TokenTree::Ident(Ident::new("_", i.span())),
            t => t,
        };
        after_quote = matches!(&t, TokenTree::Punct(p) if p.as_char() == '\'');
        out.push(t);
    }
    out.into_iter().collect()
}

/// `&mut path::Cx<..>` with the lifetime argument of `Cx` set to `lt`. Keeps the user's
/// path (so their `use` of `Cx` stays used).
fn cx_with_lifetime(ty: &syn::Type, lt: &syn::Lifetime) -> syn::Type {
    let mut ty = ty.clone();
    if let syn::Type::Reference(r) = &mut ty {
        if let syn::Type::Path(p) = &mut *r.elem {
            if let Some(last) = p.path.segments.last_mut() {
                match &mut last.arguments {
                    syn::PathArguments::AngleBracketed(a) => {
                        let existing = a
                            .args
                            .iter_mut()
                            .find(|g| matches!(g, syn::GenericArgument::Lifetime(_)));
                        match existing {
                            Some(g) => *g = syn::GenericArgument::Lifetime(lt.clone()),
                            None => a.args.insert(0, syn::GenericArgument::Lifetime(lt.clone())),
                        }
                    }
                    args => *args = syn::PathArguments::AngleBracketed(syn::parse_quote!(<#lt>)),
                }
            }
        }
    }
    ty
}

fn expand(args: &Args, sig: &Signature, f: &ItemFn) -> Option<TokenStream> {
    let rt = quote!(::hilore_runtime);
    let fn_ident = &f.sig.ident;
    let fn_name = fn_ident.to_string();
    let name = args
        .name
        .as_ref()
        .map(|s| s.value())
        .unwrap_or_else(|| fn_name.clone());
    let deterministic = args.deterministic;
    let cost = args.cost.as_ref()?;
    let cost_text = render(cost.to_token_stream());
    let codecs = match &args.codecs {
        Some(list) => quote!(::core::option::Option::Some(&[#(#list),*])),
        None => quote!(::core::option::Option::None),
    };
    let line = quote_spanned!(fn_ident.span()=> ::core::line!());

    // The model lifetime: `Cx<'m>` ties recompute closures to the module they borrow.
    let m_lt: syn::Lifetime = match &sig.cx_lifetime {
        Some(l) => l.clone(),
        None => syn::Lifetime::new("'__hilore_m", Span::call_site()),
    };
    let ctx = sig
        .params
        .iter()
        .find(|p| matches!(p.role, ParamRole::Context))?;
    let ctx_ident = &ctx.ident;
    let ctx_ty = cx_with_lifetime(&ctx.ty, &m_lt);

    let mut new_sig = f.sig.clone();
    if sig.cx_lifetime.is_none() {
        new_sig.generics.params.insert(0, syn::parse_quote!(#m_lt));
    }
    let type_params: Vec<Ident> = f
        .sig
        .generics
        .type_params()
        .map(|t| t.ident.clone())
        .collect();
    if !type_params.is_empty() {
        let wc = new_sig.generics.make_where_clause();
        for id in &type_params {
            wc.predicates.push(syn::parse_quote!(#id: #m_lt));
        }
    }
    let mut outlives = Vec::new();
    for arg in new_sig.inputs.iter_mut() {
        match arg {
            syn::FnArg::Receiver(r) => {
                if let Some((_, lt)) = &mut r.reference {
                    match lt {
                        Some(user) if *user != m_lt => outlives.push(user.clone()),
                        Some(_) => {}
                        None => {
                            *lt = Some(m_lt.clone());
                            *r.ty = syn::parse_quote!(&#m_lt Self);
                        }
                    }
                }
            }
            syn::FnArg::Typed(pt) => {
                if let syn::Pat::Ident(pi) = &mut *pt.pat {
                    // The outer function only captures its inputs; `mut` belongs to the body.
                    pi.mutability = None;
                    if pi.ident == *ctx_ident {
                        *pt.ty = ctx_ty.clone();
                    }
                }
            }
        }
    }
    for user in outlives {
        new_sig
            .generics
            .make_where_clause()
            .predicates
            .push(syn::parse_quote!(#user: #m_lt));
    }

    let params_info = sig.params.iter().map(|p| {
        let pname = p.ident.to_string();
        let ty_text = render(p.ty.to_token_stream());
        let kind = match p.role {
            ParamRole::Context => quote!(#rt::ParamKind::Context),
            _ if p.is_tape => quote!(#rt::ParamKind::Tape),
            _ => quote!(#rt::ParamKind::Config),
        };
        quote!(#rt::ParamInfo { name: #pname, ty: #ty_text, kind: #kind })
    });
    let self_info = sig.receiver.then(
        || quote!(#rt::ParamInfo { name: "self", ty: "&Self", kind: #rt::ParamKind::Module },),
    );

    // Each input: checked to be replayable, captured, and replayed from the capture. Every
    // use of the input's traits is spanned on the user's type, so an input that cannot be
    // replayed is reported once, there, with `Replayable`'s message.
    let mut checks = Vec::new();
    let mut captures = Vec::new();
    let mut tape_vars = Vec::new();
    let mut body_params = Vec::new();
    let mut call_args = Vec::new();
    for p in &sig.params {
        let pat = &p.pat;
        let id = &p.ident;
        let cap = format_ident!("__hilore_cap_{}", p.ident);
        let (ty, arg, replay) = match &p.role {
            ParamRole::Context => {
                body_params.push(quote!(#pat: #ctx_ty));
                call_args.push(quote!(__hilore_cx));
                continue;
            }
            ParamRole::ByRef(inner) => (inner, quote!(#id), quote!(replay_ref)),
            ParamRole::ByValue(t) => (t, quote!(&#id), quote!(replay)),
        };
        let (lo, hi) = span_range(ty);
        let replay_trait = match &p.role {
            ParamRole::ByValue(_) => quote!(#rt::ReplayOwned),
            _ => quote!(#rt::Replayable),
        };
        let check = quote_spanned!(lo=> __hilore_replayable::<#ty>);
        let check_args = quote_spanned!(hi=> ());
        checks.push(quote!(#check #check_args;));
        let head = quote_spanned!(lo=> <#ty as #rt::Replayable>::capture);
        let args = quote_spanned!(hi=> (#arg));
        captures.push(quote!(let #cap = #head #args;));
        let head = quote_spanned!(lo=> <#ty as #rt::Replayable>::tape_vars);
        let args = quote_spanned!(hi=> (&#cap, &mut __hilore_inputs));
        tape_vars.push(quote!(#head #args;));
        let head = quote_spanned!(lo=> <#ty as #replay_trait>::#replay);
        let args = quote_spanned!(hi=> (&#cap));
        call_args.push(quote!(#head #args));
        let erased = erase_lifetimes(p.ty.to_token_stream());
        body_params.push(quote!(#pat: #erased));
    }

    let attrs = &f.attrs;
    let vis = &f.vis;
    let block = &f.block;
    let ret = match &f.sig.output {
        syn::ReturnType::Type(_, t) => quote!(#t),
        syn::ReturnType::Default => quote!(()),
    };
    // `run_unit` requires the output to be tape values: report that on the user's type.
    let (out_lo, out_hi) = match &f.sig.output {
        syn::ReturnType::Type(_, t) => span_range(t),
        syn::ReturnType::Default => (Span::call_site(), Span::call_site()),
    };
    let output_check = sig.output.as_ref().map(|t| {
        let check = quote_spanned!(out_lo=> __hilore_unit_output::<#t>);
        let check_args = quote_spanned!(out_hi=> ());
        quote! {
            fn __hilore_unit_output<T: #rt::UnitOutput>() {}
            #check #check_args;
        }
    });
    // The call and its closure argument (where rustc reports an unmet bound on the output)
    // are spanned on the output type too, so such an error is reported once, there.
    let run_unit = quote_spanned!(out_lo=> ::hilore_runtime::__private::run_unit);
    let rc_new = quote_spanned!(out_lo=> ::hilore_runtime::__private::Rc::new);
    let replay = quote_spanned! {out_hi=>
        (move |__hilore_cx: &mut #rt::Cx<#m_lt>| __hilore_body(#(#call_args),*))
    };
    let run_args = quote_spanned! {out_hi=> (
        #ctx_ident,
        &__HILORE_UNIT,
        __hilore_cost,
        __hilore_inputs,
        #rc_new #replay,
    )};

    // In a trait impl the lifetime added above makes the method differ from the trait's
    // ("`impl` item signature doesn't match `trait` item signature"), an error that cannot
    // name the fix. So next to a method whose lifetime the macro adds goes a hidden
    // associated function whose name is the fix: harmless in an inherent impl, and in a
    // trait impl it is "not a member of trait", spanned on the method's name.
    let hint = (sig.cx_lifetime.is_none() && f.sig.receiver().is_some()).then(|| {
        let hint_ident = Ident::new(
            &format!(
                "{fn_ident}__in_a_trait_impl_a_recovery_unit_needs_the_model_lifetime_written_in_the_trait_and_the_impl__fn_{fn_ident}_m_with_self_m_and_cx_m"
            ),
            fn_ident.span(),
        );
        quote! {
            #[doc(hidden)]
            #[allow(dead_code, non_snake_case)]
            fn #hint_ident() {}
        }
    });

    Some(quote! {
        #hint
        #(#attrs)*
        #vis #new_sig {
            static __HILORE_UNIT: #rt::UnitDescriptor = #rt::UnitDescriptor {
                name: #name,
                module: ::core::module_path!(),
                function: #fn_name,
                file: ::core::file!(),
                line: #line,
                params: &[#self_info #(#params_info),*],
                deterministic: #deterministic,
                cost: #cost_text,
                codecs: #codecs,
            };
            #rt::__private::inventory::submit! {
                #rt::__private::UnitRegistration(&__HILORE_UNIT)
            }
            fn __hilore_replayable<T: ?::core::marker::Sized + #rt::Replayable>() {}
            #(#checks)*
            #output_check
            let __hilore_cost: #rt::Result<f64> = (|| -> #rt::Result<f64> {
                ::core::result::Result::Ok(#rt::__private::IntoCost::into_cost(#cost))
            })();
            let __hilore_body = move |#(#body_params),*| -> #ret #block;
            #(#captures)*
            #[allow(unused_mut)]
            let mut __hilore_inputs: ::std::vec::Vec<#rt::Var> = ::std::vec::Vec::new();
            #(#tape_vars)*
            #run_unit #run_args
        }
    })
}

/// Renders tokens the way they are usually written (`6 * x.dim(0)? * self.hidden`,
/// `&mut Cx<'a>`, `&[Var]`), for descriptors and reports. `TokenStream`'s own `Display`
/// spaces every token (`x . dim (0) ?`).
pub(crate) fn render(ts: TokenStream) -> String {
    let mut out = String::new();
    render_into(ts, &mut out);
    out
}

const KEYWORDS: &[&str] = &[
    "as", "dyn", "else", "for", "if", "impl", "in", "let", "match", "move", "mut", "return",
    "where", "while",
];

fn is_operand_end(t: Option<&TokenTree>) -> bool {
    match t {
        Some(TokenTree::Ident(i)) => !KEYWORDS.contains(&i.to_string().as_str()),
        Some(TokenTree::Literal(_) | TokenTree::Group(_)) => true,
        Some(TokenTree::Punct(p)) => p.as_char() == '?',
        None => false,
    }
}

/// Whether a `<` after `prev` opens generic arguments (`Vec<`, `::<`, a leading `<T as`)
/// rather than comparing.
fn opens_generics(prev: Option<&TokenTree>) -> bool {
    match prev {
        None => true,
        Some(TokenTree::Ident(i)) => i.to_string().starts_with(|c: char| c.is_ascii_uppercase()),
        Some(TokenTree::Punct(p)) => p.as_char() == ':',
        _ => false,
    }
}

fn punct(t: Option<&TokenTree>) -> Option<&Punct> {
    match t {
        Some(TokenTree::Punct(p)) => Some(p),
        _ => None,
    }
}

fn render_into(ts: TokenStream, out: &mut String) {
    let toks: Vec<TokenTree> = ts.into_iter().collect();
    // Open generic `<`s at this level.
    let mut angle = 0usize;
    // Whether the previous token was a unary operator or opened generics.
    let mut glue_next = false;
    for (i, t) in toks.iter().enumerate() {
        let prev = i.checked_sub(1).map(|j| &toks[j]);
        let prev2 = i.checked_sub(2).map(|j| &toks[j]);
        let next = toks.get(i + 1);
        let prev_joint = punct(prev).is_some_and(|p| p.spacing() == Spacing::Joint);
        let prev_char = punct(prev).map(|p| p.as_char());
        let mut space = prev.is_some() && !prev_joint && !glue_next;
        glue_next = false;
        match t {
            TokenTree::Punct(p) => {
                let c = p.as_char();
                match c {
                    ',' | ';' | '.' | '?' | ':' => space = false,
                    '!' if matches!(prev, Some(TokenTree::Ident(_)))
                        && matches!(next, Some(TokenTree::Group(_))) =>
                    {
                        space = false
                    }
                    '<' if opens_generics(prev) => {
                        space = space && prev.is_none();
                        angle += 1;
                        glue_next = true;
                    }
                    '>' if angle > 0 && !(prev_joint && matches!(prev_char, Some('-' | '='))) => {
                        space = false;
                        angle -= 1;
                    }
                    '&' | '*' | '-' | '!' if !is_operand_end(prev) => {
                        glue_next = p.spacing() == Spacing::Alone
                    }
                    _ => {}
                }
            }
            TokenTree::Group(g) => {
                let after_lifetime = punct(prev2).is_some_and(|p| p.as_char() == '\'');
                let call = matches!(g.delimiter(), Delimiter::Parenthesis | Delimiter::Bracket)
                    && !after_lifetime
                    && (is_operand_end(prev) || prev_char == Some('!') || prev_char == Some('>'));
                if call {
                    space = false;
                }
            }
            _ => {}
        }
        // After `.`, `::` (its second colon), `#` and `'`: no space.
        if let Some(c) = prev_char {
            let path_sep = c == ':'
                && punct(prev2)
                    .is_some_and(|p| p.as_char() == ':' && p.spacing() == Spacing::Joint);
            if c == '.' || c == '#' || c == '\'' || path_sep {
                space = false;
            }
        }
        if space {
            out.push(' ');
        }
        match t {
            TokenTree::Group(g) => {
                let (open, close) = match g.delimiter() {
                    Delimiter::Parenthesis => ("(", ")"),
                    Delimiter::Bracket => ("[", "]"),
                    Delimiter::Brace => ("{ ", " }"),
                    Delimiter::None => ("", ""),
                };
                let mut inner = String::new();
                render_into(g.stream(), &mut inner);
                if inner.is_empty() {
                    out.push_str(open.trim());
                    out.push_str(close.trim());
                } else {
                    out.push_str(open);
                    out.push_str(&inner);
                    out.push_str(close);
                }
            }
            TokenTree::Ident(i) => out.push_str(&i.to_string()),
            TokenTree::Punct(p) => out.push(p.as_char()),
            TokenTree::Literal(l) => out.push_str(&l.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::render;
    use quote::quote;

    #[test]
    fn renders_as_written() {
        let cases = [
            (
                quote!(6 * x.dim(0)? * self.hidden * self.inter),
                "6 * x.dim(0)? * self.hidden * self.inter",
            ),
            (quote!(&mut Cx), "&mut Cx"),
            (quote!(&mut Cx<'a>), "&mut Cx<'a>"),
            (quote!(&'a [Var]), "&'a [Var]"),
            (quote!(Option<&Var>), "Option<&Var>"),
            (
                quote!(hilore_runtime::Result<(Var, Var)>),
                "hilore_runtime::Result<(Var, Var)>",
            ),
            (quote!(2 * (a + b) - -1), "2 * (a + b) - -1"),
            (
                quote!(xs.len() * cfg.width as usize),
                "xs.len() * cfg.width as usize",
            ),
            (
                quote!(std::mem::size_of::<f32>() * n),
                "std::mem::size_of::<f32>() * n",
            ),
            (quote!(vec![1, 2].len() + *k), "vec![1, 2].len() + *k"),
            (
                quote!(if a < b { 1 } else { 2 }),
                "if a < b { 1 } else { 2 }",
            ),
            (quote!(Vec<Vec<f32>>), "Vec<Vec<f32>>"),
            (quote!(Box<dyn Fn(&Var) -> Var>), "Box<dyn Fn(&Var) -> Var>"),
        ];
        for (ts, want) in cases {
            assert_eq!(render(ts), want);
        }
    }
}
