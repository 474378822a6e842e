//! Code generation.

use crate::ast::{self, ParamRole, Signature};
use crate::attr::{self, Args};
use crate::ctxt::Ctxt;
use crate::valid;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::ItemFn;

pub(crate) fn recovery_unit(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let parsed_args = attr::parse(&mut cx, args);
    let f: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            cx.error_at(
                first_span(&item),
                "#[recovery_unit] applies to a function or method (`fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var>`); it cannot mark this item",
            );
            return fallback(cx, item);
        }
    };
    if parsed_args.cost.is_none() {
        cx.error_at(
            Span::call_site(),
            "missing `cost = <expr>`: the allocator needs each unit's cost estimate before anything is measured (e.g. `#[recovery_unit(cost = 2 * x.elem_count(), deterministic)]`)",
        );
    }
    let sig = ast::analyze(&mut cx, &f);
    if parsed_args.deterministic {
        valid::check_deterministic(&mut cx, &f.block);
    }
    match cx.check() {
        Ok(()) => expand(&parsed_args, &sig, &f),
        Err(e) => {
            let mut ts = e.to_compile_error();
            f.to_tokens(&mut ts);
            ts
        }
    }
}

fn first_span(ts: &TokenStream) -> Span {
    ts.clone()
        .into_iter()
        .next()
        .map(|t| t.span())
        .unwrap_or_else(Span::call_site)
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

fn expand(args: &Args, sig: &Signature, f: &ItemFn) -> TokenStream {
    let rt = quote!(::hilore_runtime);
    let fn_ident = &f.sig.ident;
    let fn_name = fn_ident.to_string();
    let name = args
        .name
        .as_ref()
        .map(|s| s.value())
        .unwrap_or_else(|| fn_name.clone());
    let deterministic = args.deterministic;
    let cost = args.cost.as_ref().expect("cost presence checked before expansion");
    let cost_text = cost.to_token_stream().to_string();
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
    let mut new_sig = f.sig.clone();
    if sig.cx_lifetime.is_none() {
        new_sig
            .generics
            .params
            .insert(0, syn::parse_quote!(#m_lt));
    }
    {
        let wc = new_sig.generics.make_where_clause();
        for g in f.sig.generics.params.iter() {
            if let syn::GenericParam::Type(t) = g {
                let id = &t.ident;
                wc.predicates.push(syn::parse_quote!(#id: #m_lt));
            }
        }
    }
    for arg in new_sig.inputs.iter_mut() {
        match arg {
            syn::FnArg::Receiver(r) => {
                if let Some((_, lt)) = &mut r.reference {
                    match lt {
                        Some(user) if *user != m_lt => {
                            let user = user.clone();
                            new_sig
                                .generics
                                .make_where_clause()
                                .predicates
                                .push(syn::parse_quote!(#user: #m_lt));
                        }
                        Some(_) => {}
                        None => {
                            *lt = Some(m_lt.clone());
                            r.ty = Box::new(syn::parse_quote!(&#m_lt Self));
                        }
                    }
                }
            }
            syn::FnArg::Typed(_) => {}
        }
    }
    // Rewrite the context parameter's type to carry the model lifetime.
    let ctx_ident = sig
        .params
        .iter()
        .find(|p| matches!(p.role, ParamRole::Context))
        .map(|p| p.ident.clone())
        .expect("context parameter presence checked before expansion");
    for arg in new_sig.inputs.iter_mut() {
        if let syn::FnArg::Typed(pt) = arg {
            if let syn::Pat::Ident(pi) = &*pt.pat {
                if pi.ident == ctx_ident {
                    let span = pt.ty.span();
                    pt.ty = Box::new(syn::parse_quote_spanned!(span=> &mut #rt::Cx<#m_lt>));
                }
            }
        }
    }

    let params_info = sig.params.iter().map(|p| {
        let pname = p.ident.to_string();
        let ty = &p.ty;
        let ty_text = quote!(#ty).to_string();
        let kind = match p.role {
            ParamRole::Context => quote!(#rt::ParamKind::Context),
            _ if p.is_tape => quote!(#rt::ParamKind::Tape),
            _ => quote!(#rt::ParamKind::Config),
        };
        quote!(#rt::ParamInfo { name: #pname, ty: #ty_text, kind: #kind })
    });
    let self_info = sig.receiver.then(|| {
        quote!(#rt::ParamInfo { name: "self", ty: "&Self", kind: #rt::ParamKind::Module },)
    });

    // Capture each replayable input; replay it from the capture (the forward itself runs
    // through the same path, so forward and recompute cannot drift apart).
    let mut captures = Vec::new();
    let mut tape_vars = Vec::new();
    let mut replays = Vec::new();
    let mut body_params = Vec::new();
    for p in &sig.params {
        let pat = &p.pat;
        let ty = &p.ty;
        match &p.role {
            ParamRole::Context => {
                body_params.push(quote!(#pat: &mut #rt::Cx<#m_lt>));
            }
            ParamRole::ByRef(inner) => {
                let cap = format_ident!("__hilore_cap_{}", p.ident);
                let id = &p.ident;
                let span = inner.span();
                captures.push(quote_spanned!(span=> let #cap = <#inner as #rt::Replayable>::capture(#id);));
                tape_vars.push(quote!(<#inner as #rt::Replayable>::tape_vars(&#cap, &mut __hilore_inputs);));
                replays.push(quote!(<#inner as #rt::Replayable>::replay_ref(&#cap)));
                body_params.push(quote!(#pat: #ty));
            }
            ParamRole::ByValue(t) => {
                let cap = format_ident!("__hilore_cap_{}", p.ident);
                let id = &p.ident;
                let span = t.span();
                captures.push(quote_spanned!(span=> let #cap = <#t as #rt::ReplayOwned>::capture(&#id);));
                tape_vars.push(quote!(<#t as #rt::Replayable>::tape_vars(&#cap, &mut __hilore_inputs);));
                replays.push(quote!(<#t as #rt::ReplayOwned>::replay(&#cap)));
                body_params.push(quote!(#pat: #ty));
            }
        }
    }
    let call_args = sig.params.iter().map(|p| match p.role {
        ParamRole::Context => quote!(__hilore_cx),
        _ => {
            let r = &replays[sig
                .params
                .iter()
                .filter(|q| !matches!(q.role, ParamRole::Context))
                .position(|q| q.ident == p.ident)
                .unwrap_or(0)];
            r.clone()
        }
    });

    let attrs = &f.attrs;
    let vis = &f.vis;
    let block = &f.block;
    let ret = match &f.sig.output {
        syn::ReturnType::Type(_, t) => quote!(#t),
        syn::ReturnType::Default => quote!(()),
    };
    let cost_span = cost.span();
    let cost_eval = quote_spanned! {cost_span=>
        let __hilore_cost: #rt::Result<f64> = (|| -> #rt::Result<f64> {
            ::core::result::Result::Ok(#rt::__private::IntoCost::into_cost(#cost))
        })();
    };

    quote! {
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
            #cost_eval
            #[allow(unused_mut)]
            let __hilore_body = move |#(#body_params),*| -> #ret #block;
            #(#captures)*
            #[allow(unused_mut)]
            let mut __hilore_inputs: ::std::vec::Vec<#rt::Var> = ::std::vec::Vec::new();
            #(#tape_vars)*
            #rt::__private::run_unit(
                #ctx_ident,
                &__HILORE_UNIT,
                __hilore_cost,
                __hilore_inputs,
                #rt::__private::Rc::new(move |__hilore_cx: &mut #rt::Cx<#m_lt>| __hilore_body(#(#call_args),*)),
            )
        }
    }
}
