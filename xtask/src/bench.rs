pub fn run(_a: &[String]) -> Result<(), String> {
    Err("todo".into())
}
pub fn report() -> Result<(), String> {
    Err("todo".into())
}
