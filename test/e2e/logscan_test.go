package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every log the tokenbroker binary writes in this package's run (the
// broker's operational log and audit trail, the agent's log, the stderr of
// every CLI command) is registered here, and TestMain scans them all once
// every test has run: no token and no private key may appear in any of
// them, whatever test made the process.

// logSource is one process's output, read when the run ends.
type logSource struct {
	name string
	text func() string
}

var collectedLogs struct {
	mu      sync.Mutex
	sources []logSource
}

// collectLog registers a process's output for the end-of-run scan.
func collectLog(name string, text func() string) {
	collectedLogs.mu.Lock()
	defer collectedLogs.mu.Unlock()
	collectedLogs.sources = append(collectedLogs.sources, logSource{name, text})
}

// secretPatterns match what must never be logged: a JWT or any base64url
// JSON object (a service account token, a join token, or a piece of one:
// base64 of `{"` is "eyJ"), a PEM private key, and the base64 DER openings
// of EC (SEC 1 and PKCS #8) and RSA private keys without their PEM armour.
var secretPatterns = []*regexp.Regexp{
	regexp.MustCompile(`eyJ[A-Za-z0-9_-]{16,}`),
	regexp.MustCompile(`PRIVATE KEY`),
	regexp.MustCompile(`MHcCAQEE|MIGHAgEAMBMG|MIIEvQIBADANBgkqhkiG9w0BAQEFAASC|MIIEowIBAAKCAQEA`),
}

// logScan is what scanLogs found.
type logScan struct {
	sources, bytes int
	leaks          []string
	// auditEvents counts the audit trail's lines; issueWithJTI those that
	// record an allowed issuance with the token's jti or the
	// certificate's serial.
	auditEvents, issueWithJTI int
	servers                   int
}

func scanLogs(sources []logSource) logScan {
	var s logScan
	for _, src := range sources {
		text := src.text()
		s.sources++
		s.bytes += len(text)
		if strings.HasPrefix(src.name, "serve ") { // a broker process, not "cli serve --help"
			s.servers++
		}
		for _, p := range secretPatterns {
			for _, m := range p.FindAllString(text, 3) {
				s.leaks = append(s.leaks, fmt.Sprintf("%s: %s…", src.name, m[:min(len(m), 24)]))
			}
		}
		sc := bufio.NewScanner(strings.NewReader(text))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var ev struct {
				Audit, Action, Decision string
				TokenJTI                string `json:"token_jti"`
				CertificateSerial       string `json:"certificate_serial"`
			}
			if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.Audit == "" {
				continue
			}
			s.auditEvents++
			if ev.Action == "issue" && ev.Decision == "allow" && (ev.TokenJTI != "" || ev.CertificateSerial != "") {
				s.issueWithJTI++
			}
		}
	}
	return s
}

func TestMain(m *testing.M) {
	code := m.Run()
	collectedLogs.mu.Lock()
	s := scanLogs(collectedLogs.sources)
	collectedLogs.mu.Unlock()
	fmt.Fprintf(os.Stderr, "log scan: %d bytes of output from %d tokenbroker processes and commands, %d audit events\n",
		s.bytes, s.sources, s.auditEvents)
	if len(s.leaks) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: a token or key in the logs:\n  %s\n", strings.Join(s.leaks, "\n  "))
		code = 1
	}
	// A run that started brokers and issued kubeconfigs must have audited
	// them; otherwise the scan looked at the wrong output.
	if s.servers > 0 && s.issueWithJTI == 0 && code == 0 && os.Getenv("E2E_LOGSCAN_LAX") == "" {
		fmt.Fprintf(os.Stderr, "FAIL: %d brokers ran but no audit event records an issuance with its token's jti or certificate's serial\n", s.servers)
		code = 1
	}
	os.Exit(code)
}

func TestTheLogScanFindsTokensAndKeys(t *testing.T) {
	t.Parallel()
	const jwt = "eyJhbGciOiJSUzI1NiIsImtpZCI6IjEifQ.eyJpc3MiOiJodHRwczovL2t1YmVybmV0ZXMifQ.c2lnbmF0dXJl"
	clean := `{"level":"info","msg":"decision","token_jti":"6a1c0a8e-1b1e-4bb4-9d7b-1d1e2f3a4b5c"}
{"audit":"tokenbroker.io/v1","action":"issue","decision":"allow","token_jti":"6a1c"}`
	for name, text := range map[string]string{
		"a whole token":       `{"msg":"x","token":"` + jwt + `"}`,
		"a token's payload":   `payload eyJpc3MiOiJodHRwczovL2t1YmVybmV0ZXMifQ`,
		"a PEM key":           "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIB...\n-----END EC PRIVATE KEY-----",
		"a bare PKCS #8 key":  `"key":"MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg"`,
		"a bare SEC 1 EC key": `MHcCAQEEIBx0`,
	} {
		s := scanLogs([]logSource{{"serve (T)", func() string { return clean + "\n" + text }}})
		require.NotEmpty(t, s.leaks, name)
	}
	s := scanLogs([]logSource{{"serve (T)", func() string { return clean }}, {"cli serve --help (stderr)", func() string { return "" }}})
	require.Empty(t, s.leaks)
	require.Equal(t, 1, s.servers, "a CLI command is not a broker")
	require.Equal(t, 1, s.auditEvents)
	require.Equal(t, 1, s.issueWithJTI)
}
