package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/tokenbroker/tokenbroker/api/schema"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "tokenbroker",
		Short: "Hand out short-lived kubeconfigs between Kubernetes clusters over mutual TLS",
		Long: `tokenbroker lets one Kubernetes cluster hand another a short-lived kubeconfig
over mutual TLS. The broker runs in the target cluster and mints tokens with
the TokenRequest API; peers authenticate with client certificates from a small
PKI (see "tokenbroker pki").`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newServeCommand(), newAgentCommand(), newGetCommand(), newDevCommand(), newPKICommand(), newEnrollCommand(), newRenewCommand(),
		newLeasesCommand(), newAuditCommand(), newConfigCommand(), newVersionCommand(), newCredentialCommand(), newInstallCommand())
	return root
}

// newViper binds a command's flags to a fresh viper instance that also
// reads TOKENBROKER_<FLAG> environment variables (dashes become
// underscores) and, when --config is given, a YAML config file whose keys
// are the flag names. Precedence: flag, environment, file, default. A key
// that is no flag, or a value that does not parse as its flag's type (viper
// would quietly read "60" as 60ns or "yes" as false), is an error.
func newViper(cmd *cobra.Command) (*viper.Viper, error) {
	v, err := newFlagViper(cmd)
	if err != nil {
		return nil, err
	}
	if file, _ := cmd.Flags().GetString("config"); file != "" {
		fv := viper.New()
		fv.SetConfigFile(file)
		if err := fv.ReadInConfig(); err != nil {
			return nil, fmt.Errorf("read config file: %w", err)
		}
		// Every unknown key and every value that does not parse as its
		// flag's type, all at once ("tokenbroker config validate --kind
		// serve" reports the same).
		settings := fv.AllSettings()
		if probs, _ := schema.FlagFileProblems(cmd.Flags(), settings); len(probs) > 0 {
			errs := make([]error, len(probs))
			for i, p := range probs {
				if rest, ok := strings.CutPrefix(p.Detail, schema.UnknownKey); ok {
					errs[i] = fmt.Errorf("config file %s: unknown key %q%s", file, p.Field, rest)
				} else {
					errs[i] = fmt.Errorf("config file %s: %s: %s", file, p.Field, p.Detail)
				}
			}
			return nil, errors.Join(errs...)
		}
		if err := v.MergeConfigMap(settings); err != nil {
			return nil, fmt.Errorf("read config file: %w", err)
		}
	}
	return v, nil
}

// newFlagViper binds a command's flags to a fresh viper instance that also
// reads TOKENBROKER_<FLAG> environment variables. It reads no config file:
// newViper adds that; the agent's --config is the agent's own file format,
// parsed by the agent package.
func newFlagViper(cmd *cobra.Command) (*viper.Viper, error) {
	v := viper.New()
	v.SetEnvPrefix("TOKENBROKER")
	v.SetEnvKeyReplacer(strings.NewReplacer("-", "_"))
	v.AutomaticEnv()
	var bindErr error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "help" {
			bindErr = errors.Join(bindErr, v.BindPFlag(f.Name, f))
		}
	})
	return v, bindErr
}

// logConfig is the logging part of every long-running command.
type logConfig struct {
	Level  string
	Format string
}

func addLogFlags(fs *pflag.FlagSet, defaultFormat string) {
	fs.String("log-level", "info", "log level: debug, info, warn or error")
	fs.String("log-format", defaultFormat, "log format: json or console")
}

func logConfigFrom(v *viper.Viper) logConfig {
	return logConfig{Level: v.GetString("log-level"), Format: v.GetString("log-format")}
}

// withLogger runs run with the logger c asks for and flushes the log
// afterwards: the prologue of every long-running command.
func withLogger(c logConfig, run func(*zap.Logger) error) error {
	log, err := newLogger(c)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	return run(log)
}

func newLogger(c logConfig) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(c.Level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	var zc zap.Config
	switch c.Format {
	case "json":
		zc = zap.NewProductionConfig()
		zc.EncoderConfig.TimeKey = "time"
		zc.EncoderConfig.EncodeTime = zapcore.RFC3339NanoTimeEncoder
	case "console":
		zc = zap.NewDevelopmentConfig()
		zc.DisableStacktrace = true
	default:
		return nil, fmt.Errorf("--log-format must be json or console, not %q", c.Format)
	}
	zc.Level = zap.NewAtomicLevelAt(level)
	return zc.Build()
}

// runE is the RunE of a command with typed settings: read gathers the
// flags, TOKENBROKER_* variables and (newViper) the --config file, from
// turns them into the command's config and checks it, run runs it.
func runE[T any](read func(*cobra.Command) (*viper.Viper, error), from func(*viper.Viper) (T, error), run func(*cobra.Command, T) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		v, err := read(cmd)
		if err != nil {
			return err
		}
		cfg, err := from(v)
		if err != nil {
			return err
		}
		return run(cmd, cfg)
	}
}
