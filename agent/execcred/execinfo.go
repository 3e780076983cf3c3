package execcred

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	clientauthv1beta1 "k8s.io/client-go/pkg/apis/clientauthentication/v1beta1"
)

// ExecInfoEnv is the environment variable in which client-go passes the
// plugin its request.
const ExecInfoEnv = "KUBERNETES_EXEC_INFO"

// MaxExecInfoBytes bounds KUBERNETES_EXEC_INFO. client-go's request is a
// few hundred bytes, or a few kilobytes with provideClusterInfo (the
// cluster's CA and its exec extension); anything larger is not from
// client-go and is refused before it is decoded.
const MaxExecInfoBytes = 256 << 10

// ExecInfo is what the plugin reads of client-go's request.
type ExecInfo struct {
	// APIVersion is the ExecCredential version to answer in.
	APIVersion string
	// Interactive says whether client-go gave the plugin a terminal; the
	// plugin never asks anything, so it only reports it.
	Interactive bool
	// FromClientGo is true when KUBERNETES_EXEC_INFO was set, that is when
	// client-go ran the plugin (every client-go since 1.22 sets it,
	// provideClusterInfo or not), rather than a person or a script.
	FromClientGo bool
	// Cluster is spec.cluster, given when the exec stanza sets
	// provideClusterInfo (a ClusterProfile access provider); nil without.
	Cluster *Cluster
}

// ExecInfoFromEnv reads KUBERNETES_EXEC_INFO with lookup (os.LookupEnv).
//
// When it is absent or empty the plugin was not run by client-go (client-go
// always sets it): a person or a script is trying the command, and the
// answer is in v1, the version client-go uses for the kubeconfigs this
// project writes and kubectl's current one. FromClientGo is then false.
func ExecInfoFromEnv(lookup func(string) (string, bool)) (ExecInfo, error) {
	v, ok := lookup(ExecInfoEnv)
	if !ok || strings.TrimSpace(v) == "" {
		return ExecInfo{APIVersion: APIVersionV1}, nil
	}
	info, err := ParseExecInfo([]byte(v))
	if err != nil {
		return ExecInfo{}, fmt.Errorf("%s: %w", ExecInfoEnv, err)
	}
	return info, nil
}

// ParseExecInfo decodes client-go's request: a JSON ExecCredential with
// apiVersion, kind and spec. It is tolerant of what it does not read
// (unknown fields, a missing kind) and strict about what decides the
// answer: the size, the JSON syntax, the types of spec.interactive and of
// spec.cluster's server, certificate-authority-data and config, an
// apiVersion it can answer in, and a config that must be a PluginTarget
// (ParsePluginTarget). Errors never quote the input beyond the apiVersion
// and kind.
func ParseExecInfo(data []byte) (ExecInfo, error) {
	if len(data) > MaxExecInfoBytes {
		return ExecInfo{}, fmt.Errorf("%d bytes, over the limit of %d", len(data), MaxExecInfoBytes)
	}
	var in struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Spec       *struct {
			Interactive bool         `json:"interactive"`
			Cluster     *execCluster `json:"cluster"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(data, &in); err != nil {
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syn):
			return ExecInfo{}, fmt.Errorf("not JSON (at byte %d)", syn.Offset)
		case errors.As(err, &typ) && typ.Field != "":
			return ExecInfo{}, fmt.Errorf("%s must not be a JSON %s", short(typ.Field), typ.Value)
		case errors.As(err, new(base64.CorruptInputError)):
			return ExecInfo{}, errors.New("spec.cluster.certificate-authority-data is not base64")
		default:
			return ExecInfo{}, errors.New("not a JSON object")
		}
	}
	if in.Kind != "" && in.Kind != "ExecCredential" {
		return ExecInfo{}, fmt.Errorf("kind %q is not ExecCredential", short(in.Kind))
	}
	switch in.APIVersion {
	case APIVersionV1, APIVersionV1beta1:
	case "":
		return ExecInfo{}, fmt.Errorf("no apiVersion: set the kubeconfig's exec apiVersion to %s", APIVersionV1)
	default:
		return ExecInfo{}, fmt.Errorf("apiVersion %q is not supported: tokenbroker credential speaks %s and %s; set the kubeconfig's exec apiVersion to one of them",
			short(in.APIVersion), APIVersionV1, APIVersionV1beta1)
	}
	info := ExecInfo{APIVersion: in.APIVersion, FromClientGo: true}
	if in.Spec != nil {
		info.Interactive = in.Spec.Interactive
		if in.Spec.Cluster != nil {
			c, err := parseCluster(in.Spec.Cluster)
			if err != nil {
				return ExecInfo{}, err
			}
			info.Cluster = c
		}
	}
	return info, nil
}

// short cuts a string from the input to a length fit for one error line.
func short(s string) string {
	const max = 64
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
}

// Status is the credential part of the plugin's answer. Token and
// ClientKeyData are secrets: String and GoString leave them out.
type Status struct {
	Token                 string
	ClientCertificateData string
	ClientKeyData         string
	// Expiration is when client-go runs the plugin again: the cache's
	// refresh point, before the credential's real expiry.
	Expiration time.Time
}

// String describes the status without its secrets.
func (s Status) String() string {
	kind := "token"
	if s.ClientCertificateData != "" {
		kind = "client certificate"
	}
	return fmt.Sprintf("exec credential{%s, expiration %s}", kind, s.Expiration.UTC().Format(time.RFC3339))
}

// GoString is String, so that %#v leaks nothing either.
func (s Status) GoString() string { return s.String() }

// Encode returns the plugin's answer: an ExecCredential of apiVersion (one
// ParseExecInfo accepts) with s, one JSON document and a newline, built
// from client-go's own types so that the fields are client-go's. The
// expiration is whole seconds, as metav1.Time writes it.
func Encode(apiVersion string, s Status) ([]byte, error) {
	if s.Token == "" && (s.ClientCertificateData == "" || s.ClientKeyData == "") {
		return nil, errors.New("encode ExecCredential: neither a token nor a certificate and its key")
	}
	exp := metav1.NewTime(s.Expiration)
	// The two versions' statuses have the same fields: one is converted
	// to the other.
	status := clientauthv1.ExecCredentialStatus{
		ExpirationTimestamp:   &exp,
		Token:                 s.Token,
		ClientCertificateData: s.ClientCertificateData,
		ClientKeyData:         s.ClientKeyData,
	}
	tm := metav1.TypeMeta{APIVersion: apiVersion, Kind: "ExecCredential"}
	var v any
	switch apiVersion {
	case APIVersionV1:
		v = &clientauthv1.ExecCredential{TypeMeta: tm, Status: &status}
	case APIVersionV1beta1:
		beta := clientauthv1beta1.ExecCredentialStatus(status)
		v = &clientauthv1beta1.ExecCredential{TypeMeta: tm, Status: &beta}
	default:
		return nil, fmt.Errorf("encode ExecCredential: apiVersion %q is not supported", short(apiVersion))
	}
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode ExecCredential: %w", err)
	}
	return append(data, '\n'), nil
}
