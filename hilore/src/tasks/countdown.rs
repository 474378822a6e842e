//! Countdown (TinyZero style): reach a target with the given numbers, each used exactly
//! once, with `+ - * /` and parentheses. `3 5 7>26:` -> `(3*7)+5`.
//!
//! Reward: 1.0 for a correct equation; 0.1 for a well-formed arithmetic expression that is
//! wrong (other numbers, or another value, or a division by zero); 0 for anything that does
//! not parse.

use super::{Example, Reward};
use crate::tokenizer::Tokenizer;
use anyhow::bail;
use hilore_models::rng::SplitMix64;

/// `numbers` numbers drawn from `1..=max_number`; the target is the value of a random
/// expression that uses each once, with every intermediate value a non-negative integer.
#[derive(Debug, Clone)]
pub struct Countdown {
    numbers: usize,
    max_number: u32,
}

/// Reward for a well-formed but wrong equation.
pub const FORMAT_REWARD: f32 = 0.1;

/// An exact rational `num / den`, `den > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

impl Ratio {
    fn int(v: i128) -> Self {
        Ratio { num: v, den: 1 }
    }

    fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num, den) * den.signum();
        Some(Ratio {
            num: num / g,
            den: den / g,
        })
    }

    fn apply(self, op: u8, o: Ratio) -> Option<Ratio> {
        let (a, b, c, d) = (self.num, self.den, o.num, o.den);
        match op {
            b'+' => Ratio::new(
                a.checked_mul(d)?.checked_add(c.checked_mul(b)?)?,
                b.checked_mul(d)?,
            ),
            b'-' => Ratio::new(
                a.checked_mul(d)?.checked_sub(c.checked_mul(b)?)?,
                b.checked_mul(d)?,
            ),
            b'*' => Ratio::new(a.checked_mul(c)?, b.checked_mul(d)?),
            _ => Ratio::new(a.checked_mul(d)?, b.checked_mul(c)?),
        }
    }
}

/// A recursive-descent parser of `expr := term (('+'|'-') term)*`,
/// `term := factor (('*'|'/') factor)*`, `factor := number | '(' expr ')'`, spaces allowed.
struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    numbers: Vec<i128>,
    /// Set when a division by zero (or an overflow) happened: well-formed, no value.
    undefined: bool,
}

impl Parser<'_> {
    fn skip(&mut self) {
        while self.i < self.s.len() && self.s[self.i] == b' ' {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip();
        self.s.get(self.i).copied()
    }

    fn combine(&mut self, a: Ratio, op: u8, b: Ratio) -> Ratio {
        match a.apply(op, b) {
            Some(r) => r,
            None => {
                self.undefined = true;
                Ratio::int(0)
            }
        }
    }

    fn expr(&mut self, depth: usize) -> Option<Ratio> {
        let mut v = self.term(depth)?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.i += 1;
            let r = self.term(depth)?;
            v = self.combine(v, op, r);
        }
        Some(v)
    }

    fn term(&mut self, depth: usize) -> Option<Ratio> {
        let mut v = self.factor(depth)?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.i += 1;
            let r = self.factor(depth)?;
            v = self.combine(v, op, r);
        }
        Some(v)
    }

    fn factor(&mut self, depth: usize) -> Option<Ratio> {
        if depth > 64 {
            return None;
        }
        match self.peek()? {
            b'(' => {
                self.i += 1;
                let v = self.expr(depth + 1)?;
                (self.peek()? == b')').then(|| self.i += 1)?;
                Some(v)
            }
            c if c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                let n: i128 = std::str::from_utf8(&self.s[start..self.i])
                    .ok()?
                    .parse()
                    .ok()?;
                self.numbers.push(n);
                Some(Ratio::int(n))
            }
            _ => None,
        }
    }
}

/// The numbers an equation uses and its value (`None`: undefined, e.g. division by zero),
/// or `None` when it does not parse.
fn parse_equation(text: &str) -> Option<(Vec<i128>, Option<Ratio>)> {
    if text.len() > 256 {
        return None;
    }
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        numbers: Vec::new(),
        undefined: false,
    };
    let v = p.expr(0)?;
    p.skip();
    if p.i != p.s.len() {
        return None;
    }
    Some((p.numbers, (!p.undefined).then_some(v)))
}

impl Countdown {
    /// `numbers` in 2..=6, `max_number` in 1..=999.
    pub fn new(numbers: usize, max_number: u32) -> anyhow::Result<Self> {
        if !(2..=6).contains(&numbers) {
            bail!("--numbers is {numbers}; Countdown uses 2 to 6 numbers");
        }
        if !(1..=999).contains(&max_number) {
            bail!("--max-number is {max_number}; it must be in 1..=999");
        }
        Ok(Countdown {
            numbers,
            max_number,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "countdown ({} numbers in 1..={})",
            self.numbers, self.max_number
        )
    }

    pub fn tokenizer(&self) -> Tokenizer {
        Tokenizer::chars("0123456789 +-*/()>:")
    }

    pub fn sample(&self, rng: &mut SplitMix64) -> Example {
        loop {
            let nums: Vec<u32> = (0..self.numbers)
                .map(|_| 1 + rng.below(self.max_number as u64) as u32)
                .collect();
            // (expression, value, is a bare number) of every pool entry.
            let mut pool: Vec<(String, i64, bool)> = nums
                .iter()
                .map(|&n| (n.to_string(), n as i64, true))
                .collect();
            let mut ok = true;
            while pool.len() > 1 && ok {
                let i = rng.below(pool.len() as u64) as usize;
                let (ea, va, ba) = pool.swap_remove(i);
                let j = rng.below(pool.len() as u64) as usize;
                let (eb, vb, bb) = pool.swap_remove(j);
                let mut picked = None;
                // Try the operators from a random start, keeping intermediate values
                // non-negative integers (the classic rules).
                let start = rng.below(4) as usize;
                for k in 0..4 {
                    let op = b"+-*/"[(start + k) % 4];
                    let v = match op {
                        b'+' => Some(va + vb),
                        b'-' if va >= vb => Some(va - vb),
                        b'*' => Some(va * vb),
                        b'/' if vb != 0 && va % vb == 0 => Some(va / vb),
                        _ => None,
                    };
                    if let Some(v) = v {
                        picked = Some((op, v));
                        break;
                    }
                }
                match picked {
                    Some((op, v)) => {
                        let wrap = |e: String, bare: bool| if bare { e } else { format!("({e})") };
                        let e = format!("{}{}{}", wrap(ea, ba), op as char, wrap(eb, bb));
                        pool.push((e, v, false));
                    }
                    None => ok = false,
                }
            }
            if !ok || pool[0].1 <= 0 || pool[0].1 > 9999 {
                continue;
            }
            let (expr, target, _) = pool.swap_remove(0);
            let listed: Vec<String> = nums.iter().map(|n| n.to_string()).collect();
            return Example {
                prompt: format!("{}>{target}:", listed.join(" ")),
                solution: expr,
                answer: format!("{}>{target}", listed.join(" ")),
            };
        }
    }

    /// 1.0: parses, uses exactly the given numbers (each once) and equals the target;
    /// 0.1: parses but is wrong; 0: does not parse.
    pub fn reward(&self, ex: &Example, response: &str) -> Reward {
        let Some((used, value)) = parse_equation(response.trim()) else {
            return Reward::ZERO;
        };
        let format_only = Reward {
            value: FORMAT_REWARD,
            correct: false,
            well_formed: true,
        };
        let Some((nums, target)) = ex.answer.split_once('>') else {
            return format_only;
        };
        let mut want: Vec<i128> = nums
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        let Ok(target) = target.trim().parse::<i128>() else {
            return format_only;
        };
        let mut used = used;
        used.sort_unstable();
        want.sort_unstable();
        if used == want && value == Some(Ratio::int(target)) {
            Reward::CORRECT
        } else {
            format_only
        }
    }

    pub fn max_prompt_chars(&self) -> usize {
        // The numbers and their separators, `>`, a target of at most 4 digits, `:`.
        let digits = self.max_number.to_string().len();
        self.numbers * digits + (self.numbers - 1) + 1 + 4 + 1
    }

    pub fn max_solution_chars(&self) -> usize {
        // Each number up to 3 digits, an operator between numbers, parentheses around
        // every inner combination.
        let digits = self.max_number.to_string().len();
        self.numbers * digits + (self.numbers - 1) + 2 * (self.numbers - 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_solutions_are_correct() {
        let t = Countdown::new(4, 20).unwrap();
        let tok = t.tokenizer();
        let mut rng = SplitMix64::new(5);
        for _ in 0..300 {
            let ex = t.sample(&mut rng);
            assert_eq!(t.reward(&ex, &ex.solution), Reward::CORRECT, "{ex:?}");
            assert!(ex.solution.len() <= t.max_solution_chars(), "{ex:?}");
            tok.encode(&ex.prompt).unwrap();
            tok.encode(&ex.solution).unwrap();
        }
    }

    #[test]
    fn reward_levels() {
        let t = Countdown::new(3, 9).unwrap();
        let ex = Example {
            prompt: "3 5 7>26:".into(),
            solution: "(3*7)+5".into(),
            answer: "3 5 7>26".into(),
        };
        // Every level is the task's weights over the reward functions `correct` and
        // `format`, in float32 (0.9 + 0.1 rounds to exactly 1).
        let weights = super::super::Task::Countdown(t.clone()).reward_weights();
        let r = |s: &str| {
            let got = t.reward(&ex, s);
            assert_eq!(got.weighted(weights), got.value, "{s:?}");
            got.value
        };
        assert_eq!(r("(3*7)+5"), 1.0);
        assert_eq!(r("5 + 3 * 7"), 1.0, "precedence without parentheses");
        assert_eq!(r("3*7+5+0"), FORMAT_REWARD, "an extra number");
        assert_eq!(r("3*7"), FORMAT_REWARD, "a missing number");
        assert_eq!(r("3*5+7"), FORMAT_REWARD, "the wrong value");
        assert_eq!(r("7/(5-5)+3"), FORMAT_REWARD, "division by zero");
        assert_eq!(r("7*3+5*1"), FORMAT_REWARD);
        // Malformed: nothing, garbage, unbalanced, trailing operator, other characters.
        for bad in [
            "",
            " ",
            "(3*7+5",
            "3*7)+5",
            "3*7+",
            "3 5 7>26:",
            "abc",
            "3**7+5",
            "()",
        ] {
            assert_eq!(r(bad), 0.0, "{bad:?}");
        }
        // Deep nesting is rejected, not a stack overflow.
        let deep = format!("{}3{}", "(".repeat(5000), ")".repeat(5000));
        assert_eq!(r(&deep), 0.0);
    }

    #[test]
    fn exact_rational_division() {
        let t = Countdown::new(3, 9).unwrap();
        let ex = Example {
            prompt: "1 3 6>2:".into(),
            solution: "6/(1+3)*...".into(),
            answer: "1 3 6>2".into(),
        };
        // 6 / 3 * 1 = 2 exactly; (1/3)*6 = 2 exactly with rationals (no float rounding).
        assert_eq!(t.reward(&ex, "6/3*1").value, 1.0);
        assert_eq!(t.reward(&ex, "1/3*6").value, 1.0);
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(Countdown::new(1, 9).is_err());
        assert!(Countdown::new(3, 0).is_err());
    }
}
