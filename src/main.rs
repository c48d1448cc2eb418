fn main() -> std::process::ExitCode {
    ossterm::cli::main()
}
